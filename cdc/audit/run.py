"""One audit run: read the table, the slot, Kafka and the group; compare; repair on request.

Guarantees of :func:`run_audit` (the stages of :mod:`cdc.audit`):

* the table is read first, in one snapshot, and its WAL position is the bound of
  what must be in Kafka: the slot's pending events below it are read next, then
  Kafka's ends - so every row the snapshot saw is in Kafka, still in the slot
  (in flight), dead-lettered, or missing; nothing committed later is judged;
* which records are this relay's is judged by :class:`cdc.evidence.Owner` (the
  server's system identifier, its timeline lineage - ancestors included - and the
  slot): a record of another cluster's relay with the same slot name, of another
  slot or timeline branch, or without ``origin`` never accounts for a row. When
  the server cannot be identified (no ``REPLICATION`` attribute, no timeline
  history: no system identity, no lineage) the run *cannot judge*: a foreign
  record carrying a row's id would hide the missing row, so the report never says
  complete - :attr:`AuditReport.cannot_judge` names why, the exit code is
  :data:`EXIT_CANNOT_JUDGE`, and ``repair`` republishes nothing (it refuses: what
  it would republish, and under which origin, is unknown);
* rows the slot still holds (committed, not confirmed: a relay behind or stuck)
  are *in flight*: never missing, never clean either - the exit code is
  :data:`EXIT_IN_FLIGHT` when nothing else was found;
* nothing of the table is locked; memory is bounded whatever the window: each id
  set keeps at most :data:`cdc.audit.ids.SPILL_BYTES` in memory (the rest in a
  temporary file), the table's groups arrive 1/4096 of a topic at a time, the
  comparison holds one bucket's objects (1/256 of the window: ~2 MB per million
  rows), and the missing ids (16 bytes each) and listed rows are kept. Measured
  (``make bench``): peak RSS 118.4 MB at 1,000,000 rows, 138.2 MB at 10,000,000;
* ``repair=True`` republishes every missing row through the one re-publish path,
  :func:`cdc.repair.republish.republish` (``recovered: audit-<run id>``), and
  returns after Kafka acknowledged them all;
* every run that may repair - an audit with ``repair``, the start-up check -
  holds the slot's audit lock (:class:`cdc.repair.lock.AuditLock`: the recovery lock's type,
  :class:`cdc.repair.lock.SlotLock` - its own connection, exempt from the
  server's idle timeouts, checked before the repair and taken again when its
  connection was lost), so two never republish at once: a second one gets
  :class:`AuditBusyError`. A lock lost and taken again during a run makes the run
  compare again under the new lock before it republishes anything;
* :func:`verify_since` is the relay's start-up check (DESIGN, relay invariant
  11): the same comparison over the window since the relay's last record, of
  the topics its routes published to and at most ``max_rows`` rows (a larger
  window is not read: :class:`WindowTooLargeError`), what is missing
  republished marked ``recovered: verify``;
* the window never starts before the relay's first start when that chose not to
  publish the rows already in the table (``slot init --from now``, an empty
  outbox: :func:`first_start`, the boundary the start-up check keeps too): a
  window that began earlier is moved to it, and a note and ``requested_since``
  say so; rows before it are judged (and repaired) only with
  ``before_first_start=True`` (``audit --before-first-start``); a window that ends
  before it raises :class:`cdc.audit.window.BeforeFirstStartError`;
* every stage's time is in :attr:`AuditReport.timings_s`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from cdc import gaps
from cdc.audit import kafka as kf
from cdc.audit import table as pg
from cdc.audit.compare import Comparison, compare
from cdc.audit.ids import IdList, uuid_text
from cdc.audit.notes import first_start_notes, report_notes
from cdc.audit.window import Window, from_first_start, iso, to_ms
from cdc.errors import CdcError
from cdc.evidence import Owner, audit_rule, origin_value
from cdc.repair.lock import AuditBusyError, SlotLock, audit_lock
from cdc.repair.republish import republish
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.slots import ServerIdentity, identify_system

log = logging.getLogger("cdc.audit")

#: Exit codes of a run (2 is the CLI's usage and configuration errors): nothing missing,
#: nothing in flight, every record's owner known;
EXIT_CLEAN = 0
#: something missing, or removed before the group processed it (like ``diff``);
EXIT_FOUND = 1
#: which records are this relay's cannot be told (no system identity or lineage): a
#: missing row may hide behind a foreign record carrying its id;
EXIT_CANNOT_JUDGE = 3
#: nothing missing, but rows still in the slot (committed, not yet in Kafka).
EXIT_IN_FLIGHT = 4

#: Missing rows listed in a report by default (all of them are counted and repaired).
LIST_LIMIT = 1_000
#: Phantom ids listed in a report.
PHANTOMS_LISTED = 100
#: The ``recovered`` header of what the start-up check republishes (an audit's says
#: ``audit-<run id>``).
VERIFY_MARK = "verify"

Progress = Callable[[str], None]
T = TypeVar("T")


class WindowTooLargeError(CdcError):
    """The start-up check's window holds more rows than it may read."""


def first_start(settings: Settings) -> datetime | None:
    """When the relay's first start made (or took over) the slot choosing not to publish
    the rows already in the table (``slot init --from now``, an empty outbox); None when
    there is no such boundary (:func:`cdc.gaps.responsible_since`)."""
    with pg.connect(settings) as conn:
        return gaps.responsible_since(conn, settings.slot)


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
    #: the relay's first start, when it chose not to publish the rows before it
    first_start: datetime | None = None
    #: the start asked for, when the window was moved to :attr:`first_start`
    requested_since: datetime | None = None
    #: why the run cannot say whether the window is complete (``cannot judge: ...``):
    #: the owner of Kafka's records could not be told; None when it could
    cannot_judge: str | None = None

    @property
    def missing_count(self) -> int:
        return len(self.comparison.missing)

    @property
    def expired_count(self) -> int:
        return sum(e.count for e in self.group.expired)

    @property
    def in_flight(self) -> int:
        """Rows of the window the slot still holds (committed, not yet in Kafka)."""
        return self.comparison.total("in_flight")

    @property
    def clean(self) -> bool:
        """Proven complete: nothing missing, nothing in flight, nothing removed before the
        group processed it, and every record's owner known."""
        return (
            not self.missing_count
            and not self.group.expired
            and not self.in_flight
            and self.cannot_judge is None
        )

    @property
    def verdict(self) -> str:
        """``found``, ``cannot judge``, ``in flight`` or ``clean`` (the first that holds)."""
        if self.missing_count or self.group.expired:
            return "found"
        if self.cannot_judge is not None:
            return "cannot judge"
        if self.in_flight:
            return "in flight"
        return "clean"

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_FOUND`, :data:`EXIT_CANNOT_JUDGE`, :data:`EXIT_IN_FLIGHT` or
        :data:`EXIT_CLEAN`, as :attr:`verdict`."""
        return {
            "found": EXIT_FOUND,
            "cannot judge": EXIT_CANNOT_JUDGE,
            "in flight": EXIT_IN_FLIGHT,
        }.get(self.verdict, EXIT_CLEAN)

    def first_missing_ids(self, count: int) -> list[str]:
        return [uuid_text(i) for i in self.comparison.missing.first(count)]

    def as_json(self) -> dict[str, Any]:
        cmp = self.comparison
        return {
            "run_id": self.run_id,
            "window": self.window.as_json(),
            "first_start": None if self.first_start is None else iso(self.first_start),
            "requested_since": None if self.requested_since is None else iso(self.requested_since),
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
                "records_passed_by": {
                    reason.value: n for reason, n in sorted(self.kafka.reader.skipped.items())
                },
                "partitions": [p.as_json() for p in self.plans],
            },
            "slot": {
                "snapshot_lsn": _lsn(self.table.snapshot_lsn),
                "confirmed_lsn": _lsn(self.pending.confirmed_lsn),
                "in_flight_known": self.pending.ids is not None,
            },
            "clean": self.clean,
            "verdict": self.verdict,
            "cannot_judge": self.cannot_judge,
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


@dataclass
class Compared:
    """The window's rows against this relay's records: what the audit and the start-up
    check share (the table in one snapshot, the slot's pending events, Kafka)."""

    table: pg.TableRead
    pending: pg.Pending
    kafka: kf.KafkaRead
    plans: list[kf.PartitionPlan]
    comparison: Comparison
    judge_phantoms: bool


def _compare(
    settings: Settings,
    window: Window,
    *,
    owner: Owner | None,
    clock: _Clock,
    horizon_ms: int,
    topics_only: Collection[str] | None = None,
    max_rows: int | None = None,
) -> Compared:
    """Read the table (one snapshot), the slot and Kafka; compare (module docstring).
    With ``max_rows``, a window of more rows raises :class:`WindowTooLargeError` before
    anything but the count is read."""
    margin_s = settings.gap_margin_s
    with (
        pg.connect(settings, autocommit=False) as conn,
        ThreadPoolExecutor(1, thread_name_prefix="audit-table") as pool,
    ):
        snapshot = pg.open_snapshot(conn, settings)
        if max_rows is not None:
            rows = pg.count_judged(snapshot, window, margin_s=margin_s)
            if rows > max_rows:
                conn.rollback()
                raise WindowTooLargeError(
                    f"{rows} rows in the window, more than {max_rows}"
                    " (CDC_START_VERIFY_MAX_ROWS): not checked (`outbox-cdc audit` covers it)"
                )
        # The table's ids are aggregated by the server while Kafka is read here: the
        # snapshot's position, all the Kafka side needs of it, is known already.
        reading = pool.submit(
            clock.timed, "table", pg.read_ids, snapshot, settings, window, margin_s=margin_s
        )
        with clock.stage("slot"):
            pending = pg.pending_in_slot(settings, snapshot.lsn)
        with clock.stage("kafka"):
            client = kf.consumer(settings)
            try:
                plans = kf.plan(client, settings, window, topics_only=topics_only)
                records = kf.read(
                    client, settings, plans, window, owner=owner, phantoms_from_ms=horizon_ms
                )
            finally:
                client.close()
        table = reading.result()
    judge_phantoms = settings.outbox_keeps_rows and owner is not None
    with clock.stage("compare"):
        comparison = compare(
            table.topics,
            records.topics,
            dead_letters=records.dead_letters,
            pending=pending.ids,
            judge_phantoms=judge_phantoms,
        )
    return Compared(table, pending, records, plans, comparison, judge_phantoms)


def _identity(settings: Settings) -> tuple[ServerIdentity | None, str]:
    """The server's identity and lineage, or None and the ``cannot judge: ...`` text."""
    try:
        return identify_system(settings.pg_dsn.get_secret_value()), ""
    except CdcError as exc:
        return None, (
            f"cannot judge: the server cannot be identified ({exc}), so which records are"
            " this relay's cannot be told - a record of another relay or cluster carrying a"
            " row's id would hide the missing row (the auditing role needs the REPLICATION"
            " attribute for IDENTIFY_SYSTEM); nothing repaired"
        )


def _republish(
    settings: Settings, missing: IdList, origin: str, found: Compared, mark: str, window: Window
) -> int:
    """The one re-publish path (:func:`cdc.repair.republish.republish`), ``lsn`` the
    snapshot's position (each row committed at or before it); every missing row was
    created in the table read's bounds (the window, from its margin before:
    :func:`cdc.audit.table.read_window`)."""
    return republish(
        settings,
        missing.view(),
        origin=origin,
        mark=mark,
        lsn=lsn_to_str(found.table.snapshot_lsn),
        created=(window.since - timedelta(seconds=settings.gap_margin_s), window.until),
    )


def run_audit(
    settings: Settings,
    window: Window,
    *,
    group: str | None = None,
    repair: bool = False,
    repair_unproven: bool = True,
    before_first_start: bool = False,
    limit: int = LIST_LIMIT,
    progress: Progress | None = None,
    now: datetime | None = None,
) -> AuditReport:
    """Audit ``window`` (see the module docstring); ``limit`` missing rows are listed.

    With ``repair`` the whole run holds the slot's audit lock (:class:`AuditBusyError`
    when another run holds it). ``repair_unproven=False`` republishes nothing when the
    slot's pending events could not be read (missing and in flight are then one count).
    The window starts no earlier than the relay's first start (:func:`first_start`)
    unless ``before_first_start``."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    with audit_lock(settings) if repair else nullcontext() as lock:  # (before anything is read)
        boundary = first_start(settings)
        judged = (
            window if before_first_start else from_first_start(window, boundary, slot=settings.slot)
        )
        report = _run(
            settings,
            judged,
            group=group,
            repair=repair,
            repair_unproven=repair_unproven,
            limit=limit,
            progress=progress,
            now=now,
            lock=lock,
        )
    report.first_start = boundary
    if judged != window:
        report.requested_since = window.since
    report.notes[:0] = first_start_notes(settings, window, judged, boundary)
    return report


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
    lock: SlotLock | None = None,
) -> AuditReport:
    clock = _Clock(progress=progress)
    now = now or datetime.now(UTC)
    run_id = uuid.uuid4().hex[:12]
    identity, cannot_judge = _identity(settings)
    owner = audit_rule(identity, settings.slot)
    margin_s = settings.gap_margin_s
    horizon_ms = to_ms(now - timedelta(seconds=settings.recovery_horizon_s))
    found = _compare(settings, window, owner=owner, clock=clock, horizon_ms=horizon_ms)
    if lock is not None and _lock_was_lost(lock):  # (compared under a lock since lost)
        found = _compare(settings, window, owner=owner, clock=clock, horizon_ms=horizon_ms)
    comparison = found.comparison
    with clock.stage("group"):
        checked = kf.expired_unprocessed(settings, group or settings.sink_group_id, found.plans)
        parked = pg.parked_by_status(settings, window, margin_s=margin_s)
    with clock.stage("describe"):
        listed = pg.describe(settings, comparison.missing.first(limit))
    report = AuditReport(
        run_id=run_id,
        window=window,
        time_basis=found.table.time_basis,
        comparison=comparison,
        table=found.table,
        pending=found.pending,
        kafka=found.kafka,
        plans=found.plans,
        group=checked,
        parked=parked,
        missing_rows=listed,
        judge_phantoms=found.judge_phantoms,
        timings_s=clock.timings,
        cannot_judge=cannot_judge or None,
    )
    report.notes = report_notes(settings, report, cannot_judge, horizon_ms)
    proven = found.pending.ids is not None  # in flight told apart from missing
    if repair and report.missing_count and (proven or repair_unproven) and identity is not None:
        if lock is not None and _lock_was_lost(lock):  # (another run may have repaired)
            raise AuditBusyError(
                f"the audit lock of slot {settings.slot} was lost before the repair and taken"
                " again: nothing republished; run the audit again"
            )
        with clock.stage("repair"):
            report.repair_mark = f"audit-{run_id}"
            origin = origin_value(identity, settings.slot)
            report.repaired = _republish(
                settings, comparison.missing, origin, found, report.repair_mark, window
            )
    return report


def _lock_was_lost(lock: SlotLock) -> bool:
    """Check the lock (taken again if its connection was lost); whether it was lost since
    the last check (what was read under the old lock may be stale)."""
    lock.ensure()
    lost, lock.retaken = lock.retaken, False
    return lost


@dataclass
class Verification:
    """What :func:`verify_since` found and did."""

    window: Window
    #: rows of the window (judged)
    table_rows: int = 0
    #: rows of the window with no record of this relay in Kafka (nor dead-lettered, nor
    #: in flight)
    missing: IdList = field(default_factory=IdList)
    in_flight: int = 0
    #: records republished (``recovered: verify``), dead letters included
    republished: int = 0
    #: records the Kafka read passed by, by reason (``reason=count, ...``)
    passed_by: str = ""
    #: why nothing was checked (the window is too large); "" when it was
    skipped: str = ""
    #: what could not be told (the slot could not be read: in flight counted missing)
    notes: list[str] = field(default_factory=list)

    def first_missing_ids(self, count: int) -> list[str]:
        return [uuid_text(i) for i in self.missing.first(count)]


def verify_since(
    settings: Settings,
    since: datetime,
    *,
    until: datetime | None = None,
    repair: bool = True,
    server: ServerIdentity | None = None,
    origin: str | None = None,
    topics: Collection[str] | None = None,
    max_rows: int | None = None,
) -> Verification:
    """The relay's start-up check: compare ``[since, until or now)`` as the audit does
    (only records of ``server``'s lineage and this slot vouch for a row; in-flight events
    - still in the slot - are not missing) and republish what is missing, marked
    ``recovered: verify`` (``origin``: the session's, by default ``server``'s with this
    slot). ``topics``: read only these (and the dead letters); a window
    of more than ``max_rows`` rows is not read (:attr:`Verification.skipped`). With
    ``repair`` it holds the slot's audit lock (:class:`AuditBusyError`)."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    window = Window.between(since, until or datetime.now(UTC))
    with audit_lock(settings) if repair else nullcontext() as lock:
        server = server or identify_system(settings.pg_dsn.get_secret_value())
        horizon_ms = to_ms(datetime.now(UTC) - timedelta(seconds=settings.recovery_horizon_s))
        try:
            found = _compare(
                settings,
                window,
                owner=audit_rule(server, settings.slot),
                clock=_Clock(),
                horizon_ms=horizon_ms,
                topics_only=topics,
                max_rows=max_rows,
            )
        except WindowTooLargeError as exc:
            return Verification(window, skipped=str(exc))
        cmp = found.comparison
        result = Verification(
            window,
            table_rows=found.table.judged_rows,
            missing=cmp.missing,
            in_flight=cmp.total("in_flight"),
            passed_by=found.kafka.reader.summary(),
        )
        if found.pending.ids is None:
            result.notes.append(
                f"in-flight events cannot be told from missing ones ({found.pending.note})"
            )
        if repair and len(cmp.missing):
            if lock is not None and _lock_was_lost(lock):  # (the audit may have repaired)
                raise AuditBusyError(
                    f"the audit lock of slot {settings.slot} was lost before the start-up"
                    " check's repair: checking again"
                )
            origin = origin or origin_value(server, settings.slot)
            result.republished = _republish(
                settings, cmp.missing, origin, found, VERIFY_MARK, window
            )
    return result
