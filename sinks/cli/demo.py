"""``make demo``: the whole pipeline on the local stack, end to end.

Migrates, starts the engine stub, the relay and the sink as child processes,
commits a burst of registrations and quiz attempts (each one transaction with
its outbox event), shows live progress until the stub has applied every one of
them, prints a summary (events, throughput, commit->engine latency, lag), stops
the children with SIGTERM and exits 0 — or 1 with the reason and the children's
log tails when something did not arrive in time. Running it again works: the
slot and the group's offsets carry over, the stub starts empty.

Day two (:func:`start_background`, :func:`sinks.cli.runfiles.stop_background`,
:func:`write_burst`):
``make run`` starts the same three processes detached on the stack, their PIDs (with
each process's start time, so a reused PID is never signalled), ports and logs under
``.dev/run`` (one of them dead, ``make run`` starts that one again and leaves the others
running); ``make stop`` ends them (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`) and names one that had exited; ``outbox-cdc demo write`` commits a
burst into the running pipeline; ``outbox-cdc demo --keep-running`` leaves its children
running the same way.

Registration goes through the backlog guard (:mod:`cdc.backlog`), as an
application's registration endpoint would: while the pipeline is over a limit
the registration is refused with a Retry-After (an HTTP app answers 429) and
the demo's client waits that long and tries again; the summary counts refusals.

The children never outlive the demo:

* before anything starts, every port a child needs is checked: one taken by
  another program stops the demo with one line naming the port and its setting
  (``CDC_RELAY_HTTP_PORT``, ``SINK_HTTP_PORT``, ``ENGINE_STUB_PORT``; exit 2),
  instead of talking to whatever listens there;
* each child runs in its own process group (a terminal's Ctrl-C reaches the
  demo only, which then stops them in order) and is stopped as a group with
  SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`, whenever the demo ends: a
  summary, an error, Ctrl-C, SIGTERM;
* each child asks the kernel for SIGTERM when the demo dies without cleaning
  up (SIGKILL, a crash): Linux's parent-death signal, set before the child's
  program starts.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cdc.backlog import BacklogGuard
from cdc.cli.app import require_free_port
from cdc.errors import CdcError
from cdc.kafka.client import first_contact
from cdc.kafka.log import KafkaClientEvents
from cdc.kafka.producer import TopicManager
from cdc.migrate import migrate
from cdc.outbox import (
    QUIZ_AGGREGATE,
    USER_AGGREGATE,
    Written,
    register_user,
    submit_quiz_attempt,
)
from cdc.settings import Settings
from sinks.cli.runfiles import (
    CHILDREN,
    STOP_GRACE_S,
    background,
    dead,
    forget,
    log_of,
    run_dir,
    urls,
    write_pid,
    write_ports,
)
from sinks.ops.lag import group_lag
from sinks.ops.offsets import lag_totals

#: The demo's last line: what it leaves running, and how to stop it.
STACK_LEFT_UP = (
    "PostgreSQL and Kafka (the stack of `make up`) keep running for the next run:"
    " `make down` stops them, `make status` shows them."
)
#: How long the demo waits for the last event before it gives up.
DEMO_TIMEOUT_S = 300.0
#: How long the summary waits for the group's committed offsets to catch up.
LAG_SETTLE_S = 15.0
#: Progress refresh period.
POLL_S = 0.25
#: The ports the children listen on: (child, settings field, host the child binds).
_CHILD_PORTS = (
    ("engine-stub", "engine_stub_port", "127.0.0.1"),  # the stub's --host default
    ("relay", "relay_http_port", None),  # None: CDC_HTTP_HOST
    ("sink", "sink_http_port", None),
)
#: Run in each child before its program: die with the demo (Linux's parent-death signal;
#: kept across exec), or right away if the demo is already gone; then exec the program.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit(143)
os.execv(sys.argv[2], sys.argv[2:])
"""


class DemoError(CdcError):
    """The demo could not finish; the message says what is missing."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"  {self.name}| {line}" for line in text)


@dataclass
class Burst:
    """What the demo committed: event id -> commit time (Unix seconds)."""

    committed: dict[str, float] = field(default_factory=dict)
    first_commit: float = 0.0
    #: Registrations the backlog guard refused (an app's 429), each retried later.
    refused: int = 0


@dataclass(frozen=True)
class Refused:
    """A registration the backlog guard turned away: try again after ``retry_after_s``."""

    retry_after_s: int
    reason: str


def register_guarded(
    conn: psycopg.Connection[Any], guard: BacklogGuard, *, group: str, email: str, name: str
) -> Written | Refused:
    """The demo app's registration path: refuse while the pipeline is over its limits
    (an HTTP handler answers ``429`` with ``Retry-After``), else register."""
    backlog = guard.check(group=group)
    if backlog.over:
        return Refused(backlog.retry_after_s, "; ".join(backlog.exceeded))
    return register_user(conn, email=email, display_name=name)


def _wait_http(url: str, child: Child, timeout_s: float = 60.0, *, unless: str = "") -> None:
    """Wait for a 200 from ``url`` whose body does not contain ``unless``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise DemoError(f"{child.name} exited during start-up:\n{child.tail()}")
        try:
            answer = httpx.get(url, timeout=1.0)
            if answer.status_code == 200 and not (unless and unless in answer.text):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise DemoError(f"{child.name} not ready at {url} after {timeout_s:.0f}s:\n{child.tail()}")


def require_free_ports(settings: Settings, *, only: frozenset[str] | None = None) -> None:
    """:class:`ConfigError` naming the port and its setting when a child's port is taken
    (``only``: of the children named)."""
    for name, field_name, host in _CHILD_PORTS:
        if only is None or name in only:
            require_free_port(settings, field_name, host=host)


def _start_child(
    name: str, args: list[str], log_dir: Path, env: dict[str, str], *, detached: bool = False
) -> Child:
    """A child of the demo (dies with it); ``detached``: one of ``make run`` or
    ``--keep-running``, in a session of its own, outliving this process."""
    log = log_dir / (f"{name}.log" if detached else f"demo-{name}.log")
    command = [sys.executable, "-m", "cdc.cli", *args]
    with log.open("ab" if detached else "wb") as out:
        if detached:
            proc = subprocess.Popen(  # noqa: S603 - our own CLI, fixed arguments
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session and group: `make stop` ends it
            )
        else:
            proc = subprocess.Popen(  # noqa: S603 - our own CLI, fixed arguments
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,  # its own group: Ctrl-C reaches the demo, which stops it
            )
    return Child(name, proc, log)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc.returncode is not None:
        return  # reaped: its pid (and group id) may belong to another process by now
    with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
        os.killpg(child.proc.pid, sig)


def stop_children(children: list[Child]) -> None:
    """SIGTERM each child's group (last started first), SIGKILL what is left after the grace."""
    for child in reversed(children):
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in reversed(children):
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.proc.wait()


def _wait_ready(settings: Settings, child: Child) -> None:
    """Wait for ``child`` to answer ready (the sink: holding its partitions too)."""
    if child.name == "engine-stub":
        _wait_http(f"http://127.0.0.1:{settings.engine_stub_port}/_stub/stats", child)
    elif child.name == "relay":
        _wait_http(f"http://127.0.0.1:{settings.relay_http_port}/readyz", child)
    else:  # ready, and holding its partitions (the group's first rebalance is done)
        _wait_http(
            f"http://127.0.0.1:{settings.sink_http_port}/readyz", child, unless="(0 partitions"
        )


@contextmanager
def running_children(
    settings: Settings,
    log_dir: Path,
    env: dict[str, str],
    *,
    keep: Path | None = None,
    only: frozenset[str] | None = None,
) -> Iterator[list[Child]]:
    """Engine stub, relay and sink (``only`` those named) started and ready; stopped (as
    groups) on the way out - unless ``keep`` (a run directory): then they are detached,
    their PIDs written there (:func:`stop_background` ends them) and stopped only when
    something failed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    kept = False
    try:
        for name, args in CHILDREN:
            if only is not None and name not in only:
                continue
            child = _start_child(name, args, keep or log_dir, env, detached=keep is not None)
            children.append(child)
            if keep is not None:
                write_pid(keep, child.name, child.proc.pid)
        for child in children:
            _wait_ready(settings, child)
        if keep is not None:
            write_ports(keep, settings)
        yield children
        kept = keep is not None
    finally:
        if not kept:
            stop_children(children)
            if keep is not None:
                forget(keep)


def start_background(*, where: Path) -> list[str]:
    """``make run``: stub, relay and sink started on the stack, detached, ready; their
    PIDs, ports and logs under ``where``. Lines for the user."""
    running, gone = background(where), dead(where)
    if len(running) == len(CHILDREN):
        pids = ", ".join(f"{n} {p}" for n, p in running.items())
        raise DemoError(f"already running ({pids}): make stop first")
    settings = Settings.from_env().require("pg_dsn", "kafka_bootstrap_servers")
    missing = frozenset(name for name, _ in CHILDREN if name not in running)
    require_free_ports(settings, only=missing)
    require_kafka(settings)
    migrate(settings.pg_dsn.get_secret_value(), demo=True)
    ensure_demo_topics(settings)
    where.mkdir(parents=True, exist_ok=True)
    with running_children(
        settings, where, demo_env(settings), keep=where, only=missing
    ) as children:
        pass
    again = {c.name: c for c in children}
    lines = [
        f"{name} (pid {pid}) had exited (see {log_of(where, name)}): started again"
        for name, pid in gone.items()
        if name in again
    ]
    for name, _ in CHILDREN:
        if name in again:
            lines.append(f"{name} running, pid {again[name].proc.pid}, log {again[name].log}")
        else:
            lines.append(f"{name} still running, pid {running[name]}, log {log_of(where, name)}")
    return [
        *lines,
        *urls(settings),
        "stop them with: make stop (outbox-cdc demo stop); the stack (PostgreSQL, Kafka):"
        " make down",
    ]


def write_burst(*, users: int, attempts_per_user: int) -> list[str]:
    """``demo write``: a burst into the running pipeline (the demo's writer, through the
    backlog guard); followed until the engine stub applied it, when a stub answers."""
    settings = Settings.from_env().require("pg_dsn", "kafka_bootstrap_servers")
    stub_url = f"http://127.0.0.1:{settings.engine_stub_port}"
    console = Console(stderr=True)
    guard = BacklogGuard(settings)
    try:
        with Progress(*_COLUMNS, console=console) as progress:
            burst = _burst(
                settings, guard, users=users, attempts_per_user=attempts_per_user, progress=progress
            )
            try:
                httpx.get(f"{stub_url}/_stub/stats", timeout=2.0)
            except httpx.HTTPError:
                return [
                    f"{len(burst.committed)} events committed; no engine stub at {stub_url}:"
                    " not followed (make run starts one)"
                ]
            applied = _follow(stub_url, burst, progress, [])
    finally:
        guard.close()
    latencies = [applied[e] - burst.committed[e] for e in burst.committed]
    return [
        f"{len(burst.committed)} events committed, {len(applied)} applied by the engine stub"
        f" (commit -> engine p50 {_percentile(latencies, 0.5) * 1000:.1f} ms)"
    ]


def _register(
    conn: psycopg.Connection[Any],
    guard: BacklogGuard,
    burst: Burst,
    *,
    group: str,
    i: int,
    run: str,
) -> Written:
    """One registration as a client sees it: on a refusal, wait Retry-After and try again."""
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while True:
        answer = register_guarded(
            conn, guard, group=group, email=f"demo-{run}-{i}@example.org", name=f"Player {i}"
        )
        if isinstance(answer, Written):
            return answer
        burst.refused += 1
        if time.monotonic() + answer.retry_after_s > deadline:
            raise DemoError(f"registrations refused for {DEMO_TIMEOUT_S:.0f}s: {answer.reason}")
        time.sleep(answer.retry_after_s)


def _burst(
    settings: Settings,
    guard: BacklogGuard,
    *,
    users: int,
    attempts_per_user: int,
    progress: Progress,
) -> Burst:
    burst = Burst()
    task = progress.add_task("committing", total=users * (1 + attempts_per_user))
    run = uuid.uuid4().hex[:8]
    with psycopg.connect(settings.pg_dsn.get_secret_value()) as conn:
        ids: list[uuid.UUID] = []
        for i in range(users):
            written = _register(conn, guard, burst, group=settings.sink_group_id, i=i, run=run)
            burst.committed[str(written.event_id)] = time.time()
            ids.append(written.entity_id)
            progress.advance(task)
        burst.first_commit = min(burst.committed.values())
        for _ in range(attempts_per_user):
            for user_id in ids:
                written = submit_quiz_attempt(
                    conn, user_id=user_id, quiz_id="demo-quiz", score=random.randint(0, 100)
                )
                burst.committed[str(written.event_id)] = time.time()
                progress.advance(task)
    return burst


def _follow(
    stub_url: str, burst: Burst, progress: Progress, children: list[Child]
) -> dict[str, float]:
    """Poll the stub until every committed event is applied; event id -> applied_at."""
    task = progress.add_task("applied by the engine", total=len(burst.committed))
    applied: dict[str, float] = {}
    seen = 0
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    with httpx.Client(base_url=stub_url, timeout=10.0) as client:
        while len(applied) < len(burst.committed):
            if time.monotonic() > deadline:
                tails = "\n".join(c.tail() for c in children)
                raise DemoError(
                    f"only {len(applied)}/{len(burst.committed)} events applied "
                    f"after {DEMO_TIMEOUT_S:.0f}s\n{tails}"
                )
            for child in children:
                if child.proc.poll() is not None:
                    raise DemoError(f"{child.name} exited:\n{child.tail()}")
            items = client.get("/_stub/applied", params={"since": seen}).json()["items"]
            seen += len(items)
            for item in items:
                if item["event_id"] in burst.committed:
                    applied[item["event_id"]] = float(item["applied_at"])
            progress.update(task, completed=len(applied))
            if len(applied) < len(burst.committed):
                time.sleep(POLL_S)
    return applied


def _settled_lag(settings: Settings) -> int:
    """The sink group's total lag once its offsets are committed (they follow within ~1 s)."""
    deadline = time.monotonic() + LAG_SETTLE_S
    while True:
        lag = lag_totals(group_lag(settings, group=settings.sink_group_id)).lag
        if lag == 0 or time.monotonic() > deadline:
            return lag
        time.sleep(0.5)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(
    console: Console, burst: Burst, applied: dict[str, float], settings: Settings, lag: int
) -> None:
    latencies = [applied[e] - burst.committed[e] for e in burst.committed]
    elapsed = max(applied.values()) - burst.first_commit
    table = Table(title="outbox-cdc demo", show_header=False)
    table.add_row("events committed (users + quiz attempts)", f"{len(burst.committed)}")
    table.add_row("events applied by the engine stub", f"{len(applied)}")
    table.add_row(
        "throughput, first commit -> last applied", f"{len(applied) / elapsed:,.0f} events/s"
    )
    table.add_row("commit -> engine latency p50", f"{_percentile(latencies, 0.5) * 1000:.1f} ms")
    table.add_row("commit -> engine latency p99", f"{_percentile(latencies, 0.99) * 1000:.1f} ms")
    table.add_row(f"consumer lag of group {settings.sink_group_id}", f"{lag}")
    table.add_row("registrations refused by the backlog guard (429)", f"{burst.refused}")
    console.print(table)
    group = settings.sink_group_id
    hints = [
        ("outbox-cdc lag", "consumer lag, oldest unprocessed age, slot lag"),
        (
            f"outbox-cdc replay --group {group} --all-topics --by-duration PT10M",
            "dry run: what a 10-minute replay redelivers",
        ),
        ("outbox-cdc slot status", "the replication slot"),
        ("outbox-cdc failed list", "the parking lot"),
    ]
    console.print("\nLook further (after `source .dev/env`, with .venv/bin on PATH):")
    for command, what in hints:
        console.print(f"  {command}\n      {what}")
    console.print("  logs: .dev/demo-relay.log .dev/demo-sink.log .dev/demo-engine-stub.log")
    console.print(
        "The demo's processes stop with it: `make run` (or `outbox-cdc demo --keep-running`)"
        " keeps a pipeline running, `outbox-cdc demo write --users N` writes into it,"
        " `make stop` ends it."
    )
    console.print(STACK_LEFT_UP)


def require_kafka(settings: Settings) -> None:
    """Kafka answers, else :class:`cdc.errors.KafkaUnreachableError` within seconds, one
    line naming ``KAFKA_BOOTSTRAP_SERVERS`` (the topics' own wait would take 30 s)."""
    events = KafkaClientEvents("demo")
    config: dict[str, Any] = {
        k: v
        for k, v in settings.kafka_config.items()
        if k.startswith(("security.", "sasl.", "ssl."))
    }
    config.update({"bootstrap.servers": settings.kafka_bootstrap_servers, **events.config()})
    with events.held():  # unreachable: the one error line says it all
        first_contact(
            AdminClient(config),
            settings.kafka_bootstrap_servers,
            events=events,
            security_protocol=config.get("security.protocol", "plaintext"),
        )


def ensure_demo_topics(settings: Settings) -> None:
    """Create the demo's topics up front so the sink's pattern subscription sees
    them from the start (it rediscovers new topics only every few seconds)."""
    TopicManager(
        bootstrap=settings.kafka_bootstrap_servers,
        overrides=settings.kafka_config,
        partitions=settings.topic_partitions,
        replication_factor=settings.topic_replication_factor,
    ).ensure([settings.topic_for(USER_AGGREGATE), settings.topic_for(QUIZ_AGGREGATE)])


def demo_env(settings: Settings) -> dict[str, str]:
    """The children's environment: ours, with a demo API key, admin token and engine URL."""
    env = dict(os.environ)
    env.setdefault("INTERNAL_API_KEY", "demo-" + secrets.token_hex(8))
    env.setdefault("ADMIN_API_TOKEN", secrets.token_hex(16))
    env.setdefault("ENGINE_BASE_URL", f"http://127.0.0.1:{settings.engine_stub_port}")
    return env


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


_COLUMNS = (
    TextColumn("{task.description:<24}"),
    BarColumn(),
    MofNCompleteColumn(),
    TimeElapsedColumn(),
)


def run_demo(
    *, users: int, attempts_per_user: int, log_dir: Path, keep_running: bool = False
) -> None:
    """Run the demo; raise :class:`DemoError` when it cannot finish."""
    settings = Settings.from_env().require("pg_dsn", "kafka_bootstrap_servers")
    require_free_ports(settings)
    require_kafka(settings)
    # SIGTERM ends the demo like Ctrl-C does: through the finally blocks that stop the children.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    console = Console()
    applied_versions = migrate(settings.pg_dsn.get_secret_value(), demo=True)
    console.print(
        f"schema: {'applied ' + ', '.join(applied_versions) if applied_versions else 'up to date'}"
    )
    ensure_demo_topics(settings)
    keep = run_dir() if keep_running else None
    if keep is not None:
        running = background(keep)
        if running:
            pids = ", ".join(f"{n} {p}" for n, p in running.items())
            raise DemoError(f"already running ({pids}): make stop first")
        keep.mkdir(parents=True, exist_ok=True)
    with running_children(settings, log_dir, demo_env(settings), keep=keep) as children:
        console.print("relay, sink and engine stub are up")
        guard = BacklogGuard(settings)
        try:
            with Progress(*_COLUMNS, console=console) as progress:
                burst = _burst(
                    settings,
                    guard,
                    users=users,
                    attempts_per_user=attempts_per_user,
                    progress=progress,
                )
                applied = _follow(
                    f"http://127.0.0.1:{settings.engine_stub_port}", burst, progress, children
                )
        finally:
            guard.close()
        lag = _settled_lag(settings)
        _summary(console, burst, applied, settings, lag)
    if keep is not None:
        console.print("\nLeft running (--keep-running):")
        for child in children:
            console.print(f"  {child.name}: pid {child.proc.pid}, log {child.log}")
        for line in urls(settings):
            console.print(f"  {line}")
        console.print("  write more: outbox-cdc demo write --users 100")
        console.print("  stop them:  make stop (outbox-cdc demo stop), then make down")
    if lag:
        raise DemoError(f"consumer group {settings.sink_group_id} still lags by {lag} records")
