"""The relay's main-thread instructions per event, counted by callgrind (load-independent).

A synthetic replication stream (a Relation of the outbox table, then transactions of
``--per-tx`` Inserts, each wrapped in an XLogData CopyData message as psycopg hands
it over: a ``memoryview``) is fed to the relay's own stream loop
(:meth:`Relay._stream_loop`: ``_read_batch``, the decoder, the delivery mode, the producer, the
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
Every module is compiled before the first run (a run that compiles what another
loads from its .pyc counts the compiler too).

``--delivery exactly-once`` replays the same stream through the exactly-once relay
(:mod:`tests.bench.relay_instructions_eos`: a transactional producer, the machine,
the commit on its own thread, the buffer); ``--delivery both`` (the default) counts
both and prints them side by side with exactly-once / at-least-once, for each
``--per-tx`` given (default 1 and 100; ``--jobs 2`` runs two valgrinds at a time:
instruction counts do not depend on the load). Needs the local stack
(``KAFKA_BOOTSTRAP_SERVERS``, from ``.dev/env``)::

    . ./.dev/env && .venv/bin/python -m tests.bench.relay_instructions --callgrind --jobs 2

It runs the ``cdc`` on ``sys.path`` (``PYTHONPATH=<another checkout>`` measures that one).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
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
ALO, EOS = "at-least-once", "exactly-once"


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

    def send_status(
        self, flushed_lsn: int, *, reply_requested: bool = False, ask_raise: bool = True
    ) -> int:
        return flushed_lsn  # (a stream without a limit)


def replay_relay(settings: Any) -> Any:
    """A :class:`~cdc.relay.stream.loop.Relay` whose slot ledger touches no database.

    A replay streams no slot: nothing vouches for one, so the real ledger's
    :meth:`~cdc.relay.gaps.ledger.SlotLedger.bound` and ``cap`` confirm as far as asked
    (their per-turn checks are still counted), and only what it would write - the
    topics and forms before their first record - is kept in memory instead (the
    replay's DSN names no server). An older checkout without a ledger module gets
    its plain relay (its guard touches no database either)."""
    from cdc.relay.stream.loop import Relay

    try:
        from cdc.relay.gaps.ledger import SlotLedger
    except ImportError:  # (before the ledger: nothing to replace)
        return Relay(settings, serve_http=False)

    class ReplayLedger(SlotLedger):
        def __init__(self, settings: Any) -> None:
            super().__init__(settings)
            #: what the relay would have recorded: kind -> names, in order
            self.noted: dict[str, list[str]] = {}

        def _note(self, kind: str, names: list[str]) -> None:
            self.noted.setdefault(kind, []).extend(names)

    if settings.delivery == "exactly-once":
        from tests.bench.relay_instructions_eos import replay_relay_eos

        return replay_relay_eos(settings, ReplayLedger)

    class ReplayRelay(Relay):
        def _new_ledger(self) -> Any:
            return ReplayLedger(self.settings)

        def _init_guard(self) -> None:  # (an older checkout's)
            self._ledger = ReplayLedger(self.settings)

    return ReplayRelay(settings, serve_http=False)


def _new_tracker(relay: Any, start_lsn: int) -> Any:
    """The session's tracker, made by the delivery mode (an older checkout: the relay)."""
    mode = getattr(relay, "mode", None)
    return mode.new_tracker(start_lsn) if mode is not None else relay._new_tracker(start_lsn)


def replay(
    events: int, per_tx: int, bootstrap: str, *, build_only: bool, delivery: str = ALO
) -> None:
    """Feed :data:`WARMUP_EVENTS` rows, then ``events`` more, through the relay's
    stream loop, each part until all its records are acknowledged.

    The relay's modules are imported before the stream is built, and the stream is
    built with the cyclic collector off and then frozen: a collection never walks
    it (one during the imports walked every message object: an artefact that grew
    with the stream and moved with the imported code)."""
    if not build_only:
        from cdc.collector import THRESHOLDS as GC_THRESHOLDS
        from cdc.kafka.producer import make_producer
        from cdc.relay.health.state import Session
        from cdc.settings import Settings
        from cdc.wal.lsn import LsnTracker
        from tests.bench.relay_instructions_eos import (
            end_part_eos,
            origin_eos,
            settings_eos,
            start_eos,
        )
    aggregate = f"ir{uuid.uuid4().hex[:12]}"  # (a new topic: the same length every run)
    gc.disable()
    warmup, lsn = build_stream(WARMUP_EVENTS, per_tx, aggregate)
    messages, end = build_stream(events, per_tx, aggregate, lsn=lsn)
    parts = [[(len(data), data) for data in part] for part in (warmup, messages)]
    gc.freeze()
    gc.enable()
    if build_only:
        return

    eos = delivery == EOS
    config: dict[str, Any] = dict(
        pg_dsn="postgresql://replay",
        kafka_bootstrap_servers=bootstrap,
        topic_partitions=PARTITIONS,
        # never at the bound: how often the loop turns while waiting for room
        # would depend on the broker's timing (valgrind runs every thread slowly)
        relay_max_in_flight=10 * (WARMUP_EVENTS + events),
    )
    settings = settings_eos(**config) if eos else Settings(**config)
    relay = replay_relay(settings)
    if hasattr(relay, "decoder"):
        relay.decoder.utf8, relay.decoder.table = True, ("public", "outbox")
    else:  # (an older checkout: the relay's own attributes)
        relay._utf8, relay._table = True, ("public", "outbox")
    topic = settings.topic_prefix + aggregate
    relay._topics.ensure([topic, settings.dlq_topic])
    origin = origin_eos() if eos else ("origin", b"7412345678901234567/1/outbox_slot")
    relay._producer = (
        start_eos(relay, bootstrap, origin)
        if eos
        else make_producer(
            bootstrap, settings.kafka_config, events=relay._events, failed_reports_only=True
        )
    )
    sess = Session(
        stream=ReplayStream(parts[0], relay.stop),  # type: ignore[arg-type]
        tracker=_new_tracker(relay, 0) if eos else LsnTracker(0),
        origin=origin,
    )
    # (each part's last Commit: its end-LSN, the checkpoint its last Kafka transaction carries)
    ends = (lsn - 0x100 + 0x28, end - 0x100 + 0x28)
    gc.freeze()  # as Relay.run does
    gc.set_threshold(*GC_THRESHOLDS)
    # The warm-up takes what happens once (the producer's first contact, the first
    # reports, lazy imports) whatever the broker's timing: both runs have it.
    totals = (WARMUP_EVENTS, WARMUP_EVENTS + events)
    for part, expected, end_lsn in zip(parts, totals, ends, strict=True):
        sess.stream = ReplayStream(part, relay.stop)  # type: ignore[assignment]
        relay._stop.clear()
        relay._stream_loop(sess)
        sess.reports = None
        if eos:  # (the part's last Kafka transaction committed, as a shutdown does)
            end_part_eos(relay, sess, end_lsn)
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


def _relay_ir(ir: dict[tuple[str, int], int]) -> float:
    """The relay's main-thread instructions per event, from the runs' totals."""
    span = SPAN[1] - SPAN[0]
    return (
        (ir["replay", SPAN[1]] - ir["replay", SPAN[0]])
        - (ir["build", SPAN[1]] - ir["build", SPAN[0]])
    ) / span


def callgrind(per_txs: list[int], deliveries: list[str], jobs: int = 1) -> None:
    """Count every (transaction size, delivery) and the stream's building, ``jobs``
    valgrind runs at a time (instruction counts do not depend on the load), and print
    the relay's Ir/event side by side (exactly-once / at-least-once too)."""
    env = dict(os.environ)
    # Every module compiled first: a run that compiles what another loads from its
    # .pyc (the first run of a fresh checkout, or two at a time) moved a run's count
    # by half a billion instructions.
    found = importlib.util.find_spec("cdc")
    assert found is not None and found.origin is not None, "cdc is not importable"
    for where in (Path(found.origin).parent, Path(__file__).parent):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(where)], check=True)
    runs: dict[tuple[int, str, str, int], list[str]] = {}
    for per_tx in per_txs:
        for kind in ("build", *deliveries):
            for events in SPAN:
                args = ["--events", str(events), "--per-tx", str(per_tx)]
                args += ["--build-only"] if kind == "build" else ["--delivery", kind]
                runs[per_tx, kind, "", events] = args
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {k: pool.submit(_main_thread_ir, args, env) for k, args in runs.items()}
        counted = {k: f.result() for k, f in futures.items()}
    print("Ir/event, main thread (the relay's: the stream's building subtracted)")
    print(f"{'per tx':>6}  " + "  ".join(f"{d:>14}" for d in deliveries) + "  ratio EOS/ALO")
    for per_tx in per_txs:
        build = {("build", n): counted[per_tx, "build", "", n] for n in SPAN}
        relay = {}
        for kind in deliveries:
            ir = {**build, **{("replay", n): counted[per_tx, kind, "", n] for n in SPAN}}
            relay[kind] = _relay_ir(ir)
        ratio = relay[EOS] / relay[ALO] if len(relay) == 2 else float("nan")
        cells = "  ".join(f"{relay[d]:>14,.0f}" for d in deliveries)
        print(f"{per_tx:>6}  {cells}  {ratio:>13.3f}")
    print(f"(raw: {counted})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=SPAN[0])
    parser.add_argument(
        "--per-tx", type=int, nargs="+", default=[1, 100], help="(a replay: the first)"
    )
    parser.add_argument(
        "--delivery", choices=[ALO, EOS, "both"], default="both", help="(a replay: both is ALO)"
    )
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--callgrind", action="store_true", help="count, as the docstring says")
    parser.add_argument("--jobs", type=int, default=1, help="valgrind runs at a time")
    args = parser.parse_args()
    if args.callgrind:
        deliveries = [ALO, EOS] if args.delivery == "both" else [args.delivery]
        callgrind(args.per_tx, deliveries, args.jobs)
        return
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
    if not bootstrap:
        sys.exit("KAFKA_BOOTSTRAP_SERVERS is not set (. ./.dev/env)")
    delivery = EOS if args.delivery == EOS else ALO
    replay(args.events, args.per_tx[0], bootstrap, build_only=args.build_only, delivery=delivery)


if __name__ == "__main__":
    main()
