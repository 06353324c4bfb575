"""Ctrl-C ends any ``outbox-cdc`` command within :data:`GRACE_S`, even inside a C call.

Guarantee: once SIGINT arrives, a command that has not ended by itself within
:data:`GRACE_S` seconds is ended with ``os._exit`` - its output flushed, exit code
:data:`EXIT_INTERRUPTED`, or the code the command declared with
:func:`interrupt_is_normal_end` (``lag --watch`` runs until Ctrl-C: that is its
normal end, exit 0).

Why a watchdog: Python runs a signal handler only between two bytecodes of the
main thread. librdkafka's calls (``list_topics``, ``committed``,
``offsets_for_times``, a consumer's ``close``) block in C with the GIL released
for up to their own timeout - tens of seconds against a broker that does not
answer - and the ``KeyboardInterrupt`` waits for them. The interpreter's C-level
handler, though, writes the signal's number to the *wakeup fd* at once
(:func:`signal.set_wakeup_fd`); a daemon thread reading it starts the clock.
The command still gets its :data:`GRACE_S` to end cleanly through its ``finally``
blocks, as before.

Long-running services own their signals and their shutdown (the relay flushes
and confirms, the sink commits): they call :func:`release` before installing
their handlers, which puts the wakeup fd back and stops the watchdog.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

#: Seconds a command has, after Ctrl-C, to end through its own ``finally`` blocks
#: before it is ended (the user's "a second or two").
GRACE_S = 1.5
#: Exit code of a command ended by Ctrl-C (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 128 + signal.SIGINT


class _Watchdog:
    """The wakeup pipe, its reader thread and the exit code a hard end uses."""

    def __init__(self) -> None:
        self.exit_code = EXIT_INTERRUPTED
        self.released = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="interrupt-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while signums := os.read(self._read_fd, 64):
            if self.released.is_set():
                return
            if signal.SIGINT in signums and not self.released.wait(GRACE_S):
                _hard_exit(self.exit_code)

    def release(self) -> None:
        self.released.set()
        with contextlib.suppress(ValueError):  # not the main thread: nothing to give back
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, self._write_fd):
                signal.set_wakeup_fd(previous)  # someone else's (asyncio's): leave it there
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")  # wake the thread so it ends


def _hard_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _Armed:
    """The process's one watchdog, when armed."""

    watchdog: _Watchdog | None = None


def arm() -> None:
    """Start the watchdog (once per process, from the main thread; else nothing)."""
    if _Armed.watchdog is not None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # Ctrl-C is ignored, or someone else's (an embedding program, a test runner)
    _Armed.watchdog = _Watchdog()


def release() -> None:
    """Give the process's signals back: for services that handle SIGINT/SIGTERM themselves."""
    if _Armed.watchdog is not None:
        _Armed.watchdog.release()
        _Armed.watchdog = None


def interrupt_is_normal_end() -> None:
    """Declare Ctrl-C the command's normal end: a hard end then exits 0."""
    if _Armed.watchdog is not None:
        _Armed.watchdog.exit_code = 0
