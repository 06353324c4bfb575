"""The relay's signal handling cannot deadlock (edge: the operator's first hour).

A Python signal handler runs in the main thread between two bytecodes, possibly
while that thread holds the lock of the ``threading.Event`` the handler would set
(inside ``Event.wait`` or ``Event.set``, or inside an earlier handler). The relay's
handler only writes to a pipe; a thread logs and sets the event. Each case runs in
a child process (its own signal handlers) with a deadline: a deadlock is a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: The child holds the stop event's lock while SIGTERMs arrive, as the main thread does
#: for an instant inside Event.wait/Event.set; then it releases it and waits for the stop.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from cdc.cli.relay import _on_signals

    stop = threading.Event()
    _on_signals(stop.set)
    with stop._cond:  # the lock Event.set takes
        for _ in range(int(sys.argv[1])):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handlers run here, while the lock is held
    print("stopped" if stop.wait(10) else "not stopped", flush=True)
    """
)


@pytest.mark.parametrize("signals", [1, 3, 50])
def test_sigterms_while_the_stop_events_lock_is_held_stop_the_relay(signals: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(signals)],
        capture_output=True,
        text=True,
        timeout=30,  # the handler that set the event itself hung here for good
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped", done.stderr
