"""The files of ``make run`` (:mod:`sinks.cli.demo`'s pipeline in the background): PIDs,
ports, and the stop.

Guarantees: each process is recorded with its PID *and* its start time
(``/proc/<pid>/stat``), so a PID the kernel reused for another process is never
signalled; :func:`stop_background` sends SIGTERM to each recorded process group (sink
first), waits up to :data:`STOP_GRACE_S`, then SIGKILLs what is left, names each recorded
process that had already exited (with its log), and forgets the files. :func:`dead` tells
``make run`` which recorded process to start again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from cdc.settings import Settings

#: A process stopped with SIGTERM gets this long before SIGKILL.
STOP_GRACE_S = 30.0
#: The pipeline's processes, in start order: name -> its ``outbox-cdc`` arguments.
CHILDREN = (("engine-stub", ["engine-stub"]), ("relay", ["relay"]), ("sink", ["sink"]))


def run_dir() -> Path:
    """Where ``make run`` keeps its PIDs, ports and logs: ``<dev dir>/run`` (.dev/run)."""
    return Path(os.environ.get("OUTBOX_DEV_DIR") or ".dev") / "run"


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None when gone or a zombie:
    with the PID, it names the process (a reused PID has another start time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def write_pid(where: Path, name: str, pid: int) -> None:
    """Record process ``name``: its PID and start time."""
    (where / f"{name}.pid").write_text(f"{pid} {start_time(pid) or '?'}\n")


def write_ports(where: Path, settings: Settings) -> None:
    (where / "ports").write_text(
        f"engine-stub http://127.0.0.1:{settings.engine_stub_port}\n"
        f"relay http://127.0.0.1:{settings.relay_http_port}\n"
        f"sink http://127.0.0.1:{settings.sink_http_port}\n"
    )


def forget(where: Path) -> None:
    for name, _ in CHILDREN:
        (where / f"{name}.pid").unlink(missing_ok=True)
    (where / "ports").unlink(missing_ok=True)


def recorded(where: Path) -> dict[str, tuple[int, str]]:
    """The processes ``make run`` recorded, alive or not: name -> (PID, start time)."""
    found: dict[str, tuple[int, str]] = {}
    for name, _ in CHILDREN:
        try:
            pid_text, started = (where / f"{name}.pid").read_text().split()
            found[name] = (int(pid_text), started)
        except (OSError, ValueError):
            continue
    return found


def background(where: Path) -> dict[str, int]:
    """The processes of ``make run`` still running: name -> PID (a PID file whose process
    is gone, or whose PID now names another process, does not count)."""
    return {
        name: pid for name, (pid, started) in recorded(where).items() if start_time(pid) == started
    }


def dead(where: Path) -> dict[str, int]:
    """The processes ``make run`` recorded that are no longer running: name -> PID."""
    alive = background(where)
    return {name: pid for name, (pid, _) in recorded(where).items() if name not in alive}


def log_of(where: Path, name: str) -> Path:
    """Where a process of ``make run`` writes its log."""
    return where / f"{name}.log"


def urls(settings: Settings) -> list[str]:
    return [
        f"engine stub http://127.0.0.1:{settings.engine_stub_port}/_stub/stats",
        f"relay       http://127.0.0.1:{settings.relay_http_port}/readyz",
        f"sink        http://127.0.0.1:{settings.sink_http_port}/readyz"
        " (admin API: ADMIN_API_TOKEN of .dev/env)",
    ]


def stop_background(*, where: Path) -> list[str]:
    """``make stop``: SIGTERM each process of ``make run`` (sink first), wait up to
    :data:`STOP_GRACE_S`, SIGKILL what is left. Lines for the user."""
    running, gone = background(where), dead(where)
    lines = [
        f"{name} (pid {pid}) was not running: it had exited (see {log_of(where, name)})"
        for name, pid in gone.items()
    ]
    if not running:
        forget(where)
        return [*lines, "nothing running (no live process in " + str(where) + ")"]
    for name, _ in reversed(CHILDREN):
        if name in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running[name], signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while background(where) and time.monotonic() < deadline:
        time.sleep(0.1)
    for name, pid in running.items():
        if name in background(where):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            lines.append(f"{name} (pid {pid}) killed: it did not stop within {STOP_GRACE_S:g}s")
        else:
            lines.append(f"{name} (pid {pid}) stopped")
    forget(where)
    return lines
