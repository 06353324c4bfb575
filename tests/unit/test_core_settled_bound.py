"""The sink core's memory bound counts records settled behind one that is not (issue 35).

A record that waits to be parked (the parking lot is down) holds its
partition's commit; records delivered after it stay in the watermark until
it is parked. They are held memory like any other: above ``max_buffered``
the partitions pause, and once the parking lot takes the record everything
commits and the partitions resume.
"""

from __future__ import annotations

from sinks.core.backoff import Backoff, Jitter
from sinks.core.delivery import Envelope
from sinks.core.machine import (
    DELIVERED,
    Commit,
    Disposition,
    Park,
    Pause,
    Resume,
    Send,
    SinkCore,
    Verdict,
)

TP = ("user", 0)
MAX_BUFFERED = 50


def _classify(record: Envelope) -> Verdict:
    if record.headers.get("type") == b"Unroutable":
        return Verdict(Disposition.PARK, "no route for event type 'Unroutable'")
    return Verdict(Disposition.DELIVER)


def _core() -> SinkCore:
    return SinkCore(
        max_in_flight=8,
        max_buffered=MAX_BUFFERED,
        inline_attempts=3,
        inline_backoff_s=0.2,
        backoff=lambda: Backoff(base_s=0.5, cap_s=4.0, jitter=Jitter.NONE),
        commit_interval_s=1.0,
        classify=_classify,
    )


def _record(offset: int, event_type: bytes = b"UserRegistered") -> Envelope:
    return Envelope(
        topic=TP[0],
        partition=TP[1],
        offset=offset,
        key=f"user-{offset}".encode(),
        value=b"{}",
        headers={"type": event_type, "id": f"id-{offset}".encode()},
        timestamp_ms=1,
    )


class _Shell:
    """Carries the core's actions out: every Send delivered, every Park failed or done."""

    def __init__(self, core: SinkCore) -> None:
        self.core = core
        self.paused = False
        self.resumed = False
        self.parked: list[int] = []
        self.commits: list[Commit] = []

    def step(self, now: float, *, lot_up: bool) -> None:
        for _ in range(3):  # answers settle records: the next actions pause, commit ...
            for action in self.core.actions(now=now):
                self.carry_out(action, now, lot_up=lot_up)

    def carry_out(self, action: object, now: float, *, lot_up: bool) -> None:
        if isinstance(action, Send):
            self.core.sent(action.record, DELIVERED, now=now)
        elif isinstance(action, Park):
            for item in action.items:
                if lot_up:
                    self.parked.append(item.record.offset)
                    self.core.parked(item.record)
                else:
                    self.core.park_failed(item.record, now=now)
        elif isinstance(action, Pause):
            self.paused = True
        elif isinstance(action, Resume):
            self.paused, self.resumed = False, True
        elif isinstance(action, Commit):
            self.commits.append(action)


def test_records_delivered_behind_an_unparked_one_count_toward_the_pause() -> None:
    core = _core()
    core.assign([TP])
    shell = _Shell(core)
    shell.step(0.0, lot_up=False)
    core.consumed(_record(0, b"Unroutable"), now_ms=0)
    offset, now = 1, 0.0
    for _ in range(40):  # fetch batches of 10 while the parking lot fails every Park
        if not shell.paused:
            for _ in range(10):
                core.consumed(_record(offset), now_ms=0)
                offset += 1
        shell.step(now, lot_up=False)
        now += 0.1
        assert core.held <= MAX_BUFFERED + 10, f"{core.held} records held"
    assert shell.paused, "the partition kept fetching while nothing could commit"
    assert core.committable(*TP) is None, "committed past the record not parked"
    assert core.held > MAX_BUFFERED
    assert core.queued == 0 and core.in_flight == 1, "every good record was delivered"

    # The parking lot is back: the record parks, everything commits, fetching resumes.
    shell.resumed = False
    shell.step(now + 60.0, lot_up=True)
    shell.step(now + 62.0, lot_up=True)  # the next commit round
    assert shell.parked == [0]
    assert core.held == 0
    assert core.committable(*TP) == offset
    assert shell.commits[-1].offsets == ((TP[0], TP[1], offset),)
    assert shell.resumed and not shell.paused
