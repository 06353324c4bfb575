"""One audit run: read the table, the slot, Kafka and the group; compare; repair on request.

Guarantees of :func:`run_audit` (the stages of :mod:`cdc.audit`):

* the table is read first, in one snapshot, and its WAL position is the bound of
  what must be in Kafka: the slot's pending events below it are read next, then
  Kafka's ends - so every row the snapshot saw is in Kafka, still in the slot
  (in flight), dead-lettered, or missing; nothing committed later is judged;
* nothing of the table is locked; memory is the compact id arrays (16 bytes per
  row and per record) plus one bucket's objects and the listed missing rows;
* ``repair=True`` republishes every missing row (:mod:`cdc.audit.repair`) and
  returns after Kafka acknowledged them all; runs that may repair hold an
  advisory lock per slot (:func:`audit_lock`), so two never republish at once;
* every stage's time is in :attr:`AuditReport.timings_s`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from cdc.audit import kafka as kf
from cdc.audit import table as pg
from cdc.audit.compare import Comparison, compare
from cdc.audit.ids import uuid_text
from cdc.audit.repair import republish
from cdc.audit.window import Window, iso, to_ms
from cdc.errors import CdcError
from cdc.settings import Settings
from cdc.wal.slots import ServerIdentity, identify_system

log = logging.getLogger("cdc.audit")

#: Missing rows listed in a report by default (all of them are counted and repaired).
LIST_LIMIT = 1_000
#: Phantom ids listed in a report.
PHANTOMS_LISTED = 100

Progress = Callable[[str], None]
T = TypeVar("T")


class AuditBusyError(CdcError):
    """Another audit that may repair runs on the same slot."""

    retriable = True


@contextmanager
def audit_lock(settings: Settings) -> Iterator[None]:
    """Hold the slot's audit lock (a session advisory lock) or raise :class:`AuditBusyError`."""
    with pg.connect(settings) as conn:
        key = f"outbox_cdc_audit:{settings.slot}"
        row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)).fetchone()
        if not row or not row[0]:
            raise AuditBusyError(f"another audit of slot {settings.slot} is running")
        yield


@dataclass
class AuditReport:
    """Everything one run found (see :meth:`as_json` for the document scripts read)."""

    run_id: str
    window: Window
    time_basis: str
    comparison: Comparison
    table: pg.TableRead
    pending: pg.Pending
    kafka: kf.KafkaRead
    plans: list[kf.PartitionPlan]
    group: kf.GroupCheck
    parked: pg.Parked
    missing_rows: list[pg.MissingRow]
    judge_phantoms: bool
    repaired: int = 0
    repair_mark: str | None = None
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def missing_count(self) -> int:
        return len(self.comparison.missing)

    @property
    def expired_count(self) -> int:
        return sum(e.count for e in self.group.expired)

    @property
    def clean(self) -> bool:
        """Nothing missing, nothing removed before the group processed it."""
        return not self.missing_count and not self.group.expired

    @property
    def exit_code(self) -> int:
        """0 clean, 1 something missing or expired (like ``diff``)."""
        return 0 if self.clean else 1

    def first_missing_ids(self, count: int) -> list[str]:
        return [uuid_text(i) for i in self.comparison.missing.first(count)]

    def as_json(self) -> dict[str, Any]:
        cmp = self.comparison
        return {
            "run_id": self.run_id,
            "window": self.window.as_json(),
            "time_basis": self.time_basis,
            "table_rows": self.table.judged_rows,
            "in_kafka": cmp.total("in_kafka"),
            "dead_lettered": cmp.total("dead_lettered"),
            "in_flight": cmp.total("in_flight"),
            "missing": [row.as_json() for row in self.missing_rows],
            "missing_count": self.missing_count,
            "phantoms": self._phantoms_json(),
            "unchecked": cmp.unchecked,
            "duplicates": {
                "ids": cmp.total("duplicate_ids"),
                "extra_records": cmp.total("duplicate_records"),
            },
            "expired_unprocessed": [e.as_json() for e in self.group.expired],
            "uncommitted_removed": [
                {"topic": t, "partition": p, "log_start_offset": low}
                for t, p, low in self.group.uncommitted
            ],
            "group": self.group.group,
            "parked": self.parked.by_status,
            "repaired": self.repaired,
            "repair_mark": self.repair_mark,
            "topics": {topic: counts.as_json() for topic, counts in cmp.per_topic.items()},
            "kafka": {
                "records_read": self.kafka.records_read,
                "records_without_id": dict(self.kafka.without_id),
                "partitions": [p.as_json() for p in self.plans],
            },
            "slot": {
                "snapshot_lsn": _lsn(self.table.snapshot_lsn),
                "confirmed_lsn": _lsn(self.pending.confirmed_lsn),
                "in_flight_known": self.pending.ids is not None,
            },
            "clean": self.clean,
            "notes": self.notes,
            "timings_s": {k: round(v, 3) for k, v in self.timings_s.items()},
        }

    def _phantoms_json(self) -> dict[str, Any]:
        phantoms = self.comparison.phantoms
        return {
            "judged": self.judge_phantoms,
            "count": len(phantoms),
            "ids": [uuid_text(i) for i in phantoms.first(PHANTOMS_LISTED)],
        }


def _lsn(value: int | None) -> str | None:
    return None if value is None else f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass
class _Clock:
    timings: dict[str, float] = field(default_factory=dict)
    progress: Progress | None = None

    def timed(self, name: str, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``func(*args, **kwargs)`` as stage ``name`` (for a stage run on another thread)."""
        with self.stage(name):
            return func(*args, **kwargs)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.progress is not None:
            self.progress(name)
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = time.monotonic() - started


def _read_kafka(
    settings: Settings, window: Window, identity: ServerIdentity | None, horizon_ms: int
) -> tuple[kf.KafkaRead, list[kf.PartitionPlan]]:
    client = kf.consumer(settings)
    try:
        plans = kf.plan(client, settings, window)
        records = kf.read(
            client,
            settings,
            plans,
            window,
            ours=kf.OriginJudge(identity, settings.slot),
            phantoms_from_ms=horizon_ms,
        )
    finally:
        client.close()
    return records, plans


def _identity(settings: Settings) -> tuple[ServerIdentity | None, str]:
    try:
        return identify_system(settings.pg_dsn.get_secret_value()), ""
    except CdcError as exc:
        return None, f"cannot identify the server ({exc}): phantoms not judged"


def run_audit(
    settings: Settings,
    window: Window,
    *,
    group: str | None = None,
    repair: bool = False,
    repair_unproven: bool = True,
    limit: int = LIST_LIMIT,
    progress: Progress | None = None,
    now: datetime | None = None,
) -> AuditReport:
    """Audit ``window`` (see the module docstring); ``limit`` missing rows are listed.

    With ``repair`` the whole run holds the slot's audit lock (:class:`AuditBusyError`
    when another run holds it). ``repair_unproven=False`` republishes nothing when the
    slot's pending events could not be read (missing and in flight are then one count)."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    with audit_lock(settings) if repair else nullcontext():
        return _run(
            settings,
            window,
            group=group,
            repair=repair,
            repair_unproven=repair_unproven,
            limit=limit,
            progress=progress,
            now=now,
        )


def _run(
    settings: Settings,
    window: Window,
    *,
    group: str | None,
    repair: bool,
    repair_unproven: bool,
    limit: int,
    progress: Progress | None,
    now: datetime | None,
) -> AuditReport:
    clock = _Clock(progress=progress)
    now = now or datetime.now(UTC)
    run_id = uuid.uuid4().hex[:12]
    identity, identity_note = _identity(settings)
    margin_s = settings.gap_margin_s
    horizon_ms = to_ms(now - timedelta(seconds=settings.recovery_horizon_s))
    with (
        pg.connect(settings, autocommit=False) as conn,
        ThreadPoolExecutor(1, thread_name_prefix="audit-table") as pool,
    ):
        snapshot = pg.open_snapshot(conn, settings)
        # The table's ids are aggregated by the server while Kafka is read here: the
        # snapshot's position, all the Kafka side needs of it, is known already.
        reading = pool.submit(
            clock.timed, "table", pg.read_ids, snapshot, settings, window, margin_s=margin_s
        )
        with clock.stage("slot"):
            pending = pg.pending_in_slot(settings, snapshot.lsn)
        with clock.stage("kafka"):
            records, plans = _read_kafka(settings, window, identity, horizon_ms)
        table = reading.result()
    judge_phantoms = settings.outbox_keeps_rows and identity is not None
    with clock.stage("compare"):
        comparison = compare(
            table.topics,
            records.topics,
            dead_letters=records.dead_letters,
            pending=pending.ids,
            judge_phantoms=judge_phantoms,
        )
    with clock.stage("group"):
        checked = kf.expired_unprocessed(settings, group or settings.sink_group_id, plans)
        parked = pg.parked_by_status(settings, window, margin_s=margin_s)
    with clock.stage("describe"):
        listed = pg.describe(settings, comparison.missing.first(limit))
    report = AuditReport(
        run_id=run_id,
        window=window,
        time_basis=table.time_basis,
        comparison=comparison,
        table=table,
        pending=pending,
        kafka=records,
        plans=plans,
        group=checked,
        parked=parked,
        missing_rows=listed,
        judge_phantoms=judge_phantoms,
        timings_s=clock.timings,
    )
    report.notes = _notes(settings, report, identity_note, horizon_ms)
    proven = pending.ids is not None  # in flight told apart from missing
    if repair and report.missing_count and (proven or repair_unproven):
        with clock.stage("repair"):
            done = republish(
                settings,
                comparison.missing,
                run_id=run_id,
                snapshot_lsn=table.snapshot_lsn,
                identity=identity or identify_system(settings.pg_dsn.get_secret_value()),
            )
        report.repaired, report.repair_mark = done.records, done.mark
    return report


def _notes(
    settings: Settings, report: AuditReport, identity_note: str, horizon_ms: int
) -> list[str]:
    """What the reader must know to trust (or not) each number."""
    notes = [identity_note] if identity_note else []
    if report.pending.ids is None:
        notes.append(
            f"in-flight events cannot be told from missing ones ({report.pending.note}):"
            " rows the relay has not published yet are counted missing"
        )
    if report.time_basis == pg.CREATED_AT:
        notes.append(
            "track_commit_timestamp is off: rows are placed in the window by created_at"
            " (their transaction's start); rows of transactions open longer than"
            f" CDC_GAP_MARGIN_S ({settings.gap_margin_s:g}s) may be judged at the window's edge"
        )
    if report.window.since_ms < horizon_ms:
        notes.append(
            f"the window starts before the recovery horizon (CDC_RECOVERY_HORIZON_S): rows"
            f" older than {iso(datetime.fromtimestamp(horizon_ms / 1000, UTC))} may have been"
            " pruned; phantoms are judged only after it"
        )
    if not settings.outbox_keeps_rows:
        notes.append(
            f"CDC_OUTBOX_KEEPS_ROWS=false: {report.comparison.unchecked} records of this relay"
            " in the window have no row to be checked against (events not kept in the table)"
        )
    elif len(report.comparison.phantoms):
        notes.append(
            "phantoms are records of this relay with no row in the table: logical-message"
            " events (emit_event) and delete-after-insert writes are never in the table, so"
            " they are counted here and cannot be checked"
        )
    without_id = sum(report.kafka.without_id.values())
    if without_id:
        notes.append(f"{without_id} records had no readable id header (not checked)")
    for note in (report.group.note, report.parked.note):
        if note:
            notes.append(note)
    return notes


def verify_since(
    settings: Settings, since: datetime, *, until: datetime | None = None, repair: bool = True
) -> AuditReport:
    """The relay's start-up verification: audit ``[since, until or now)`` and republish
    what is missing (in-flight events - still in the slot - are not missing)."""
    end = until or datetime.now(UTC)
    return run_audit(settings, Window.between(since, end), repair=repair)
