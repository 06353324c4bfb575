"""StallProbe (issue 47 item 6): the fetch watch's broker requests, off the consumer thread.

No broker: the probe's client points at a port nothing listens on; its requests fail
within their timeout, on the probe's own thread - the asking thread never waits.
"""

from __future__ import annotations

import socket
import time

from sinks.kafka.offset_expiry import WATERMARK_TIMEOUT_S
from sinks.kafka.stall_probe import Answer, Question, StallProbe


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_asking_never_waits_for_the_broker_and_a_partition_is_asked_about_once_at_a_time() -> None:
    answers: list[Answer] = []
    config = {"bootstrap.servers": f"127.0.0.1:{_closed_port()}", "group.id": "g"}
    probe = StallProbe(config, answer=answers.append).start()
    try:
        started = time.monotonic()
        asked = [probe.ask(Question(("t", p), 5, 30.0, 0.0)) for p in range(24)]
        again = probe.ask(Question(("t", 0), 5, 30.0, 0.0))
        took_s = time.monotonic() - started
    finally:
        probe.stop()
    assert all(asked) and again is False, "one question per partition waits at a time"
    # (not a speed: less than one broker request's timeout for 24 of them - none waited)
    assert took_s < WATERMARK_TIMEOUT_S, f"24 questions took {took_s:.1f} s to ask"
    assert answers == []  # (no broker: no answer, nothing restarted)
