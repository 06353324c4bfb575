"""Ctrl-C ends a command even while it waits inside a librdkafka call (cdc.cli.interrupt).

The broker here is a socket that accepts connections and never answers: librdkafka's
call then blocks in C, with the GIL released, until its own timeout. Each test gives
that call a timeout far longer than the test waits, so a process that ends proves it
was ended by the watchdog, not by the call returning.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

#: Far longer than any wait below: the call never returns by itself during a test.
C_CALL_TIMEOUT_S = 600
#: How long a test waits for the interrupted process (generous: a loaded CI machine).
WAIT_S = 60


@pytest.fixture
def silent_broker() -> Iterator[tuple[str, socket.socket]]:
    """A TCP listener that accepts and never answers (a broker hung mid-request)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}", listener


def _wait_connected(listener: socket.socket) -> socket.socket:
    """The client's first connection: from here on it waits inside librdkafka."""
    listener.settimeout(WAIT_S)
    conn, _ = listener.accept()
    time.sleep(0.3)  # let the call be well inside C
    return conn


def _interrupt(proc: subprocess.Popen[str], listener: socket.socket) -> tuple[int, str]:
    conn = _wait_connected(listener)
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_ctrl_c_ends_a_command_blocked_in_a_kafka_call_with_the_interrupted_exit_code(
    silent_broker: tuple[str, socket.socket],
) -> None:
    bootstrap, listener = silent_broker
    program = textwrap.dedent(
        f"""
        from confluent_kafka.admin import AdminClient
        from cdc.cli import interrupt
        interrupt.arm()
        AdminClient({{"bootstrap.servers": "{bootstrap}"}}).list_topics(timeout={C_CALL_TIMEOUT_S})
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    returncode, err = _interrupt(proc, listener)

    assert returncode == 128 + signal.SIGINT, err


def test_ctrl_c_ends_lag_watch_blocked_on_a_silent_broker_with_exit_zero(
    silent_broker: tuple[str, socket.socket],
) -> None:
    bootstrap, listener = silent_broker
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "LOG_LEVEL": "WARNING"}
    env.pop("CDC_PG_DSN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdc.cli", "lag", "--watch", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    returncode, err = _interrupt(proc, listener)

    assert returncode == 0, err


def test_a_service_that_releases_the_watchdog_keeps_its_own_shutdown() -> None:
    program = textwrap.dedent(
        """
        import os, signal, sys, time
        from cdc.cli import interrupt
        interrupt.arm()
        interrupt.release()
        stopping = []
        signal.signal(signal.SIGINT, lambda *_: stopping.append(time.monotonic()))
        print("ready", flush=True)
        while not stopping:
            time.sleep(0.05)
        time.sleep(3)  # a clean shutdown longer than the watchdog's grace
        print("clean", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)

    assert (proc.returncode, out.strip()) == (0, "clean"), err
