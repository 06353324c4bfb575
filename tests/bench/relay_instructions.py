"""The relay's main-thread instructions per event, counted by callgrind (load-independent).

A synthetic replication stream (a Relation of the outbox table, then transactions of
``--per-tx`` Inserts, each wrapped in an XLogData CopyData message as psycopg hands
it over: a ``memoryview``) is fed to the relay's own stream loop
(:meth:`Relay._stream_loop`: ``_read_batch``, the fast path, the producer, the
delivery reports, status updates) with a real producer and the local broker, until
every record is acknowledged. Only the replication connection is replaced (its
``get_nowait`` a C call, as psycopg's is), and the slot ledger's writes (a replay
streams no slot and touches no database: :func:`replay_relay`). The stream is the
same every run (seeded ids) and so are dict layouts (``PYTHONHASHSEED=0``). A
warm-up of 1,000 events comes first in every run (what happens once, whatever the
broker's timing), and the in-flight bound is never reached (how often the loop
turns while waiting for room would depend on the broker's timing).

``--callgrind`` runs that under ``valgrind --tool=callgrind --separate-threads=yes``
for 2,000 and 22,000 events, and for building the stream alone, and prints the
main thread's instructions per event::

    relay Ir/event = ((Ir(22,000) - Ir(2,000)) - (build(22,000) - build(2,000))) / 20,000

The difference cancels start-up; the wide span keeps the broker's timing (which
moves a run's start-up by a few thousand instructions per event at 4,000) small.
Needs the local stack (``KAFKA_BOOTSTRAP_SERVERS``, from ``.dev/env``)::

    . ./.dev/env && .venv/bin/python -m tests.bench.relay_instructions --callgrind --per-tx 100

It runs the ``cdc`` on ``sys.path`` (``PYTHONPATH=<another checkout>`` measures that one).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

OID = 16_500
PG_EPOCH_US = 946_684_800_000_000
#: The outbox table of sql/001_outbox.sql: (name, type oid).
COLUMNS = (
    ("id", 2950),
    ("aggregatetype", 25),
    ("aggregateid", 25),
    ("type", 25),
    ("payload", 3802),
    ("created_at", 1184),
    ("tracingspancontext", 25),
)
PARTITIONS = 6
#: Events replayed (and acknowledged) before the counted ones, in both runs.
WARMUP_EVENTS = 1_000
SPAN = (2_000, 22_000)


def _cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def _xlog(lsn: int, payload: bytes) -> memoryview:
    return memoryview(b"w" + struct.pack(">QQq", lsn, lsn, 0) + payload)


def _relation() -> bytes:
    body = b"".join(b"\0" + _cstr(n) + struct.pack(">Ii", t, -1) for n, t in COLUMNS)
    head = b"R" + struct.pack(">I", OID) + _cstr("public") + _cstr("outbox") + b"d"
    return head + struct.pack(">H", len(COLUMNS)) + body


def _insert(values: list[bytes | None]) -> bytes:
    out = [b"I", struct.pack(">IcH", OID, b"N", len(values))]
    for value in values:
        out.append(b"n" if value is None else b"t" + struct.pack(">I", len(value)) + value)
    return b"".join(out)


def build_stream(
    events: int, per_tx: int, aggregate: str, *, lsn: int = 0x1_0000_0000
) -> tuple[list[memoryview], int]:
    """The CopyData messages of ``events`` outbox rows, ``per_tx`` a transaction
    (the same ones every run: ids from a seeded generator), from ``lsn`` on, and
    the LSN after them. The first part of a stream (``lsn`` at its default) starts
    with the outbox's Relation."""
    rng = random.Random(events)
    ts_us = 1_795_000_000_123_456 - PG_EPOCH_US
    created = b"2026-11-29 10:00:00.123456+00"
    messages = [_xlog(0, _relation())] if lsn == 0x1_0000_0000 else []
    agg = aggregate.encode()
    for lo in range(0, events, per_tx):
        final_lsn = lsn + 0x100 * (per_tx + 2)
        messages.append(_xlog(lsn, b"B" + struct.pack(">QqI", final_lsn, ts_us, 7)))
        for i in range(lo, min(lo + per_tx, events)):
            lsn += 0x100
            payload = (
                b'{"email": "u%d@example.org", "user_id": "%s", "display_name": "User %d",'
                b' "registered_at": "2026-11-29T10:00:00.123456+00:00"}'
                % (i, str(uuid.UUID(int=rng.getrandbits(128), version=4)).encode(), i)
            )
            event_id = str(uuid.UUID(int=rng.getrandbits(128), version=4)).encode()
            row = [event_id, agg, b"u%d" % i, b"UserRegistered"]
            messages.append(_xlog(lsn, _insert([*row, payload, created, None])))
        commit = b"C" + struct.pack(">BQQq", 0, final_lsn, final_lsn + 0x28, ts_us)
        messages.append(_xlog(final_lsn, commit))
        lsn = final_lsn + 0x100
    return messages, lsn


#: The walsender's ``wal_sender_timeout`` a replayed session reports: PostgreSQL's
#: default, so the relay's silence watch has the finite bound of a real session.
WAL_SENDER_TIMEOUT_MS = 60_000


class ReplayStream:
    """The replication connection's part the stream loop uses, replaying ``messages``;
    at their end it stops the relay (its loop then returns)."""

    def __init__(self, pairs: list[tuple[int, memoryview]], stop: object) -> None:
        #: a C call, as the relay's own (a bound psycopg function): no Python frame
        self.get_nowait = partial(next, iter(pairs), (0, None))
        self._stop = stop
        self.backend_pid = 0
        self.wal_sender_timeout_ms = WAL_SENDER_TIMEOUT_MS

    def read(self, timeout_s: float) -> memoryview | None:
        nbytes, data = self.get_nowait()
        if nbytes:
            return data
        self._stop()  # type: ignore[operator]
        return None

    def send_status(self, flushed_lsn: int, *, reply_requested: bool = False) -> None:
        pass


def replay_relay(settings: Any) -> Any:
    """A :class:`~cdc.relay.loop.Relay` whose slot ledger touches no database.

    A replay streams no slot: nothing vouches for one, so the real ledger's
    :meth:`~cdc.relay.ledger.SlotLedger.bound` and ``cap`` confirm as far as asked
    (their per-turn checks are still counted), and only what it would write - the
    topics and forms before their first record - is kept in memory instead (the
    replay's DSN names no server). An older checkout without a ledger module gets
    its plain relay (its guard touches no database either)."""
    from cdc.relay.loop import Relay

    try:
        from cdc.relay.ledger import SlotLedger
    except ImportError:  # (before the ledger: nothing to replace)
        return Relay(settings, serve_http=False)

    class ReplayLedger(SlotLedger):
        def __init__(self, settings: Any) -> None:
            super().__init__(settings)
            #: what the relay would have recorded: kind -> names, in order
            self.noted: dict[str, list[str]] = {}

        def _note(self, kind: str, names: list[str]) -> None:
            self.noted.setdefault(kind, []).extend(names)

    class ReplayRelay(Relay):
        def _init_guard(self) -> None:
            self._ledger = ReplayLedger(self.settings)

    return ReplayRelay(settings, serve_http=False)


def replay(events: int, per_tx: int, bootstrap: str, *, build_only: bool) -> None:
    """Feed :data:`WARMUP_EVENTS` rows, then ``events`` more, through the relay's
    stream loop, each part until all its records are acknowledged.

    The relay's modules are imported before the stream is built, and the stream is
    built with the cyclic collector off and then frozen: a collection never walks
    it (one during the imports walked every message object: an artefact that grew
    with the stream and moved with the imported code)."""
    if not build_only:
        from cdc.producer import make_producer
        from cdc.relay.loop import GC_THRESHOLDS
        from cdc.relay.state import Session
        from cdc.settings import Settings
        from cdc.wal.lsn import LsnTracker
    aggregate = f"ir{uuid.uuid4().hex[:12]}"  # (a new topic: the same length every run)
    gc.disable()
    warmup, lsn = build_stream(WARMUP_EVENTS, per_tx, aggregate)
    messages, _ = build_stream(events, per_tx, aggregate, lsn=lsn)
    parts = [[(len(data), data) for data in part] for part in (warmup, messages)]
    gc.freeze()
    gc.enable()
    if build_only:
        return

    settings = Settings(
        pg_dsn="postgresql://replay",
        kafka_bootstrap_servers=bootstrap,
        topic_partitions=PARTITIONS,
        # never at the bound: how often the loop turns while waiting for room
        # would depend on the broker's timing (valgrind runs every thread slowly)
        relay_max_in_flight=10 * (WARMUP_EVENTS + events),
    )
    relay = replay_relay(settings)
    relay._utf8 = True
    relay._table = ("public", "outbox")
    topic = settings.topic_prefix + aggregate
    relay._topics.ensure([topic, settings.dlq_topic])
    relay._producer = make_producer(
        bootstrap, settings.kafka_config, events=relay._events, failed_reports_only=True
    )
    sess = Session(
        stream=ReplayStream(parts[0], relay.stop),  # type: ignore[arg-type]
        tracker=LsnTracker(0),
        origin=("origin", b"7412345678901234567/1/outbox_slot"),
    )
    gc.freeze()  # as Relay.run does
    gc.set_threshold(*GC_THRESHOLDS)
    # The warm-up takes what happens once (the producer's first contact, the first
    # reports, lazy imports) whatever the broker's timing: both runs have it.
    for part, expected in zip(parts, (WARMUP_EVENTS, WARMUP_EVENTS + events), strict=True):
        sess.stream = ReplayStream(part, relay.stop)  # type: ignore[assignment]
        relay._stop.clear()
        relay._stream_loop(sess)
        sess.reports = None
        deadline = time.monotonic() + 600  # (under callgrind, on a loaded machine)
        while sess.tracker.in_flight and time.monotonic() < deadline:
            relay._poll(0.1)
        relay._send_status(sess)  # (moves the acknowledged counts into the metric)
        acked = relay.registry.get_sample_value("outbox_relay_events_total", {"topic": topic})
        if sess.tracker.in_flight or acked != expected or sess.fatal or sess.fault:
            failed = sess.fatal or sess.fault
            sys.exit(f"replay incomplete: {acked} of {expected} acknowledged, {failed}")
    relay._producer.flush(30)
    # A relay records its topic before its first record to it (an older checkout
    # measured with this file may have no ledger at all).
    noted = getattr(getattr(relay, "_ledger", None), "noted", None)
    if noted is not None and noted != {"topic": [topic]}:
        sys.exit(f"the replay's ledger recorded {noted}, not [{topic}]")


def _main_thread_ir(args: list[str], env: dict[str, str]) -> int:
    env = {**env, "PYTHONHASHSEED": "0"}  # (the same dict layouts every run)
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--separate-threads=yes",
                f"--callgrind-out-file={out}/cg.out",
                sys.executable,
                "-m",
                "tests.bench.relay_instructions",
                *args,
            ],
            env=env,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if run.returncode:
            lines = [line for line in run.stderr.splitlines() if not line.startswith("==")]
            tail = "\n".join(lines[-5:])
            sys.exit(f"replay {args} under callgrind failed (exit {run.returncode}):\n{tail}")
        main = Path(f"{out}/cg.out-01").read_text(errors="replace")
        found = re.search(r"^(?:summary|totals): (\d+)", main, re.M)
        assert found, "no summary in callgrind's output"
        return int(found.group(1))


def callgrind(per_tx: int) -> None:
    env = dict(os.environ)
    ir = {}
    for build_only in (False, True):
        for events in SPAN:
            args = ["--events", str(events), "--per-tx", str(per_tx)]
            ir[build_only, events] = _main_thread_ir(
                args + (["--build-only"] if build_only else []), env
            )
    span = SPAN[1] - SPAN[0]
    total = (ir[False, SPAN[1]] - ir[False, SPAN[0]]) / span
    build = (ir[True, SPAN[1]] - ir[True, SPAN[0]]) / span
    print(
        f"{per_tx}-event tx: replay {total:,.0f} Ir/event, building the stream {build:,.0f},"
        f" the relay {total - build:,.0f}  (raw: {ir})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=SPAN[0])
    parser.add_argument("--per-tx", type=int, default=100)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--callgrind", action="store_true", help="count, as the docstring says")
    args = parser.parse_args()
    if args.callgrind:
        callgrind(args.per_tx)
        return
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
    if not bootstrap:
        sys.exit("KAFKA_BOOTSTRAP_SERVERS is not set (. ./.dev/env)")
    replay(args.events, args.per_tx, bootstrap, build_only=args.build_only)


if __name__ == "__main__":
    main()
