"""The relay's slot guard: the gap check before every session, the recovery behind it, and the
start-up check of what the last start published.

Guarantees:

* a session streams only after :func:`cdc.relay.gap.decide` said so, or after
  the slot was made (first start on an empty outbox, ``CDC_SLOT_INIT``) or
  adopted (no identity recorded, nothing against it) and its identity recorded
  in the slot history, or after a gap was closed - recovered from the outbox
  table with every record acknowledged, or the loss accepted by an operator;
  every session then confirms no further than the slot's confirm limit
  (:class:`cdc.relay.ledger.SlotLedger`);
* a slot another process streams is not inspected (no tail read): the relay
  waits as a standby;
* a gap is recorded (``open`` in the slot history) and recovered only under the
  slot's recovery lock (:mod:`cdc.relay.recovery_lock`), after checking that the
  history did not move since the gap check: a relay that does not get the lock
  waits as a standby and records nothing;
* a gap is logged once (per gap) at ERROR, saying what happened, which kinds of
  events the table cannot give back (if any) and what the relay will do,
  counted in ``outbox_relay_gaps_total{cause}``; the relay is in state ``gap``
  (``/readyz`` 503 ``gap: <cause>: <detail>``) until it is closed;
* ``CDC_GAP_RECOVERY=manual``, a gap the table cannot replay, or a first start on a
  non-empty outbox with ``CDC_SLOT_INIT=refuse`` keeps the relay in ``gap``: it
  checks again every :data:`GAP_RECHECK_S` and goes on once an operator ran
  ``outbox-cdc slot recover --execute``, ``slot accept-gap`` or ``slot init``;
* records the tail read passed by (another producer's, unreadable ones) are
  counted in ``outbox_relay_tail_records_skipped_total{reason}`` and logged once
  per start at INFO;
* **the start-up check**: once a session has confirmed past the WAL position of
  its start, the rows committed between the relay's last record in Kafka (minus
  the margin; never before its first start when that chose not to publish the
  rows already there) and that start (minus the margin) are checked against the
  relay's records in its topics by the audit's comparison
  (:func:`cdc.audit.verify_since`: only records of this relay's system, timeline
  lineage and slot vouch for a row); missing ones are re-published through the
  one re-publish path, marked ``recovered: verify``. It holds the slot's audit
  lock while it checks and repairs: while an audit holds it, the check waits
  (polling every :data:`START_CHECK_POLL_S`, at most :data:`START_CHECK_BUSY_WAIT_S`),
  so the two never repair at once and the check sees what the audit republished;
  a wait is logged once when it begins (INFO) and once when it ends (INFO when
  the check proceeds, WARNING when it gives up), never per poll.
  It runs in a thread, once per process (again at the next session if it failed
  or waited too long), and never stops the stream.
* every slot the guard creates (first start, recovery) is a failover slot when
  ``CDC_FAILOVER_SLOT`` asks for one on this server (auto: PostgreSQL 17+), and a
  slot it streams on is altered to match before the session starts; after a
  failover, the slot the server synchronized to the promoted standby is streamed
  on without a gap (:func:`cdc.relay.gap.decide`).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import psycopg
from confluent_kafka import KafkaException

from cdc import constants as c
from cdc import gaps
from cdc.audit.run import AuditBusyError, verify_since
from cdc.audit.window import Window, to_ms
from cdc.errors import CdcError, DatabaseSetupError, StreamError
from cdc.lineage import LastRecord, origin_value
from cdc.relay import recovery
from cdc.relay.gap import Action, GapCause, Verdict
from cdc.relay.ledger import SlotLedger
from cdc.relay.metrics import RelayMetrics
from cdc.relay.recovery_lock import RecoveryLock
from cdc.relay.state import RelayState
from cdc.settings import Settings
from cdc.wal.replproto import str_to_lsn
from cdc.wal.slots import (
    FAILOVER_SLOTS_MIN_VERSION,
    ServerIdentity,
    SlotRow,
    alter_failover,
    failover_wanted,
    read_slot,
)

if TYPE_CHECKING:
    from cdc.producer import TopicManager

log = logging.getLogger("cdc.relay")

#: Missing ids the start-up check's WARNING line names.
LOGGED_IDS = 5
#: A relay waiting in `gap` checks the slot and the history again this often.
GAP_RECHECK_S = 5.0
#: The start-up check polls the slot's confirmed LSN this often until it passes the start,
#: and the audit lock this often while an audit holds it.
START_CHECK_POLL_S = 2.0
#: Longest the start-up check waits for an audit holding the slot's audit lock (an audit
#: of a 1,000,000-row window takes tens of seconds; `outbox-cdc audit --repair` of a
#: wider one longer): past it, the check is tried again at the next session.
START_CHECK_BUSY_WAIT_S = 1_800.0


class SlotGapError(CdcError):
    """The slot has a gap the relay does not close by itself: it waits in state ``gap``."""

    retriable = True


class SlotGuard:
    """The relay's gap check (a mixin of :class:`~cdc.relay.loop.Relay`)."""

    if TYPE_CHECKING:
        settings: Settings
        metrics: RelayMetrics
        _topics: TopicManager
        _gaps_reported: set[int]
        _stop: threading.Event

        def _set_state(self, state: RelayState, reason: str = "") -> None: ...

    #: the relay's records of its slot (made in :meth:`_init_guard`)
    _ledger: SlotLedger
    #: the start-up check: running or done (once per process)
    _start_check: threading.Thread | None = None
    _start_checked = False
    _refusal_reported = False

    def _init_guard(self) -> None:
        self._ledger = SlotLedger(self.settings)

    def _guard_slot(self) -> tuple[str, bytes]:
        """Check the slot; make it (first start), adopt it or close a gap; the session's
        ``origin`` header. Raises :class:`SlotGapError` while a gap stays open, and
        :class:`cdc.errors.SlotInUseError` when another process streams the slot."""
        s = self.settings
        self.metrics.gap_checks.inc()
        found = recovery.inspect(
            s, slot_survives_failover=self._slot_survives_failover(), standby=True
        )
        self._observe_slot(found.slot)
        self._count_passed_by(found)
        verdict = found.verdict
        origin = origin_value(found.server, s.slot)
        if verdict.action is Action.REFUSE:
            verdict = self._first_start_choice(verdict)
        if verdict.action in (Action.CREATE, Action.ADOPT):
            self._make_slot(found, verdict)
        elif verdict.action is Action.GAP:
            # SlotInUseError: another process recovers: a standby, recording nothing
            with RecoveryLock(s) as lock:
                _check_history_unmoved(lock, found)
                gap = (
                    recovery.open_gap(s, found)
                    if verdict.cause is not None
                    else recovery.open_first_start(s)
                )
                origin = self._close_gap(gap, lock)
        if verdict.action in (Action.STREAM, Action.ADOPT) and found.slot is not None:
            self._match_failover(found.slot)
        with recovery.connect(s) as conn:
            maker = gaps.maker(conn, s.slot)
            if not found.topics_recorded and found.tails.topics_with_ours:
                gaps.note_output(
                    conn, s.slot, gaps.OUTPUT_TOPIC, list(found.tails.topics_with_ours)
                )
            start = conn.execute(
                "SELECT pg_current_wal_lsn()::text, statement_timestamp()"
            ).fetchone()
            since = gaps.responsible_since(conn, s.slot)
        if maker is None or maker.confirm_limit_lsn is None:
            raise SlotGapError(f"slot {s.slot} has no recorded identity after the gap check")
        self._ledger.vouch(maker.id, maker.confirm_limit_lsn)
        assert start is not None
        self._arm_start_check(found.last, found.server, origin, str(start[0]), start[1], since)
        return (c.HEADER_ORIGIN, origin.encode())

    def _first_start_choice(self, verdict: Verdict) -> Verdict:
        """A first start on a non-empty outbox: what ``CDC_SLOT_INIT`` chose, else wait."""
        choice = self.settings.slot_init
        if choice == "now":
            return Verdict(
                Action.CREATE,
                detail="first start (CDC_SLOT_INIT=now: the rows already in the outbox table"
                " are not published)",
            )
        if choice == "table":
            return Verdict(Action.GAP)  # (cause None: a first_start gap over the table)
        if not self._refusal_reported:
            self._refusal_reported = True
            log.error("relay refuses to start: %s", verdict.detail)
        self._set_state(RelayState.GAP, verdict.reason)
        raise SlotGapError(verdict.reason)

    def _make_slot(self, found: recovery.Inspection, verdict: Verdict) -> None:
        s = self.settings
        first = found.history is None and found.last is None
        cause = "first_start" if first else "upgrade"
        if found.verdict.action is Action.REFUSE:  # (CDC_SLOT_INIT=now chose)
            cause = "init_now"
        made = recovery.make_slot(s, found, cause=cause, detail=verdict.detail)
        if found.slot is None:
            log.info("%s: slot %s created at %s", verdict.detail, s.slot, made.lsn)
        elif first or cause == "init_now":
            log.info("%s: slot %s adopted at %s", verdict.detail, s.slot, made.lsn)
        else:
            log.warning("%s (at %s)", verdict.detail, made.lsn)

    def _match_failover(self, slot: SlotRow) -> None:
        """PostgreSQL 17+: make the slot's ``failover`` property what ``CDC_FAILOVER_SLOT``
        asks (a slot of an older relay, or made before the setting changed). An active slot
        (another relay streams it) is left to that relay; ``auto`` carries on with a warning
        when the server refuses, ``on`` stops the session."""
        s = self.settings
        dsn = s.pg_dsn.get_secret_value()
        with recovery.connect(s) as conn:
            version = conn.info.server_version
        wanted = failover_wanted(s.failover_slot, version)
        if version < FAILOVER_SLOTS_MIN_VERSION or slot.failover == wanted or slot.active:
            return
        try:
            alter_failover(dsn, s.slot, wanted)
        except StreamError as exc:
            if s.failover_slot == "on":
                raise DatabaseSetupError(
                    f"slot {s.slot} could not be made a failover slot: {exc}"
                ) from exc
            log.warning("slot %s: failover property left %s: %s", s.slot, slot.failover, exc)
            return
        log.info("slot %s is now %sa failover slot", s.slot, "" if wanted else "not ")

    def _slot_survives_failover(self) -> bool:
        """True when the slot is a failover slot (PostgreSQL 17+, synchronised to the
        standby): an existing slot under a new timeline is then trusted. Off here; the
        standby-safe mode decides it."""
        return False

    def _close_gap(self, gap: gaps.HistoryRow, lock: RecoveryLock) -> str:
        s = self.settings
        reason = f"{gap.cause}: {gap.detail}"
        if gap.cause == GapCause.FIRST_START:  # (chosen explicitly: not a gap to report)
            log.info("%s: slot %s: publishing them now (gap %d)", gap.detail, s.slot, gap.id)
            self._set_state(RelayState.GAP, reason)
            return self._recover(gap, lock)
        if gap.unrecoverable:
            todo = (
                "publishing nothing until an operator accepts the loss"
                " (`outbox-cdc slot accept-gap --by NAME`)"
            )
        elif s.gap_recovery == "manual":
            todo = "waiting for `outbox-cdc slot recover --execute` (CDC_GAP_RECOVERY=manual)"
        else:
            todo = "recovering the window from the outbox table now"
        self._report_gap(gap, reason, todo)
        self._set_state(RelayState.GAP, reason)
        if gap.unrecoverable or s.gap_recovery == "manual":
            raise SlotGapError(reason)
        return self._recover(gap, lock)

    def _recover(self, gap: gaps.HistoryRow, lock: RecoveryLock) -> str:
        s = self.settings
        done = recovery.recover(s, gap, topics=self._topics, lock=lock)
        window_s = (
            (done.window_end - done.window_start).total_seconds() if done.window_start else 0.0
        )
        self.metrics.recovered.inc(done.rows)
        self.metrics.last_recovery_window.set(window_s)
        self.metrics.last_recovery_duration.set(done.seconds)
        log.warning(
            "gap %d recovered: %d outbox rows re-published (window %s .. %s, %.0fs wide) in %.1fs;"
            " streaming slot %s from %s",
            gap.id,
            done.rows,
            done.window_start.isoformat() if done.window_start else "the first row",
            done.window_end.isoformat(),
            window_s,
            done.seconds,
            s.slot,
            done.consistent_lsn,
            extra={"state": RelayState.GAP.value},
        )
        return done.origin

    def _report_gap(self, gap: gaps.HistoryRow, reason: str, todo: str) -> None:
        """Log the gap once (per gap id) at ERROR and count it."""
        if gap.id in self._gaps_reported:
            return
        self._gaps_reported.add(gap.id)
        self.metrics.gaps.labels(gap.cause).inc()
        start = gap.window_start.isoformat() if gap.window_start else "the first outbox row"
        log.error(
            "slot gap %d on %s: %s; events committed since %s may be missing from Kafka; %s",
            gap.id,
            self.settings.slot,
            reason,
            start,
            todo,
            extra={"state": RelayState.GAP.value},
        )

    def _observe_slot(self, slot: SlotRow | None) -> None:
        """wal_status and safe_wal_size gauges (also refreshed by the monitor thread)."""
        observe_slot(self.metrics, slot)

    def _count_passed_by(self, found: recovery.Inspection) -> None:
        reader = found.tails.reader
        for reason, count in reader.skipped.items():
            self.metrics.tail_records_skipped.labels(reason.value).inc(count)
        if reader.skipped:
            log.info(
                "slot %s: the tails of %d topic(s) held records of others, passed by: %s",
                self.settings.slot,
                len(found.tails.topics),
                reader.summary(),
            )

    # -- the start-up check ----------------------------------------------------------

    def _arm_start_check(
        self,
        last: LastRecord | None,
        server: ServerIdentity,
        origin: str,
        start_lsn: str,
        start_at: datetime,
        since: datetime | None,
    ) -> None:
        """Check (in a thread) the window since ``last`` (never before ``since``: the rows
        committed before the relay's first start are not its own) once the slot
        confirmed past ``start_lsn``; once per process (again at the next session if it
        failed)."""
        if self._start_checked or (self._start_check is not None and self._start_check.is_alive()):
            return
        if last is None:  # nothing of the relay's in Kafka: nothing published to check
            self._start_checked = True
            return
        margin = timedelta(seconds=self.settings.gap_margin_s)
        begin = last.commit_ts - margin
        begin = begin if since is None else max(begin, since)
        end = start_at - margin
        if to_ms(end) <= to_ms(begin):
            self._start_checked = True
            return
        self._start_check = threading.Thread(
            target=self._start_check_run,
            args=(Window.between(begin, end), server, origin, str_to_lsn(start_lsn)),
            name="start-check",
            daemon=True,
        )
        self._start_check.start()

    def _start_check_run(
        self, window: Window, server: ServerIdentity, origin: str, start_lsn: int
    ) -> None:
        try:
            if not self._wait_confirmed(start_lsn):
                return
            self._start_checked = self._start_check_window(window, server, origin)
        except (CdcError, KafkaException, psycopg.Error, OSError, ValueError) as exc:
            log.warning(
                "start-up check of slot %s failed (tried again at the next session): %s",
                self.settings.slot,
                exc,
            )
        except Exception as exc:  # (a thread's error would only be printed)
            log.exception("start-up check of slot %s failed: %s", self.settings.slot, exc)

    def _wait_confirmed(self, lsn: int) -> bool:
        """Until the slot confirmed past ``lsn`` (every earlier transaction is in Kafka)."""
        while not self._stop.is_set():
            with recovery.connect(self.settings) as conn:
                slot = read_slot(conn, self.settings.slot)
            if slot is not None and slot.confirmed_flush_lsn >= lsn:
                return True
            self._stop.wait(START_CHECK_POLL_S)
        return False

    def _start_check_window(self, window: Window, server: ServerIdentity, origin: str) -> bool:
        """Check ``window`` and republish what is missing, under the slot's audit lock
        (waiting while an audit holds it); True when it was checked (or too large to)."""
        s = self.settings
        with recovery.connect(s) as conn:
            topics = gaps.outputs(conn, s.slot, gaps.OUTPUT_TOPIC)
        span = f"{window.as_json()['since']} .. {window.as_json()['until']}"
        began = time.monotonic()
        deadline = began + START_CHECK_BUSY_WAIT_S
        waited = False
        while True:
            try:
                found = verify_since(
                    s,
                    window.since,
                    until=window.until,
                    server=server,
                    origin=origin,
                    topics=topics,
                    max_rows=s.start_verify_max_rows,
                )
                if waited:
                    log.info(
                        "start-up check of slot %s proceeds: the audit lock was free after %.0fs",
                        s.slot,
                        time.monotonic() - began,
                    )
                break
            except AuditBusyError as exc:
                if time.monotonic() > deadline:
                    log.warning(
                        "start-up check of slot %s (%s) not done: %s for more than %gs"
                        " (tried again at the next session)",
                        s.slot,
                        span,
                        exc,
                        START_CHECK_BUSY_WAIT_S,
                    )
                    return False
                if not waited:  # (one line per wait, not one per poll)
                    log.info(
                        "start-up check of slot %s waits (at most %gs): %s",
                        s.slot,
                        START_CHECK_BUSY_WAIT_S,
                        exc,
                    )
                    waited = True
                if self._stop.wait(START_CHECK_POLL_S):
                    return False
        if found.skipped:
            log.warning("start-up check of slot %s skipped (%s): %s", s.slot, span, found.skipped)
            return True
        if not found.missing:
            log.info(
                "start-up check of slot %s: the %d outbox rows committed in %s are in Kafka",
                s.slot,
                found.table_rows,
                span,
            )
            return True
        self.metrics.start_check_republished.inc(found.republished)
        log.warning(
            "start-up check of slot %s: %d of the %d outbox rows committed in %s were not in"
            " Kafka (first: %s): re-published (header recovered=verify)%s",
            s.slot,
            len(found.missing),
            found.table_rows,
            span,
            ", ".join(found.first_missing_ids(LOGGED_IDS)),
            "; " + "; ".join(found.notes) if found.notes else "",
            extra={"state": RelayState.STREAMING.value},
        )
        return True


def _check_history_unmoved(lock: RecoveryLock, found: recovery.Inspection) -> None:
    """Under the recovery lock: the slot history is as the gap check saw it (else another
    process recorded or closed a gap meanwhile, and the check is done again)."""
    now = gaps.latest(lock.checked(), lock.slot)
    seen = found.history
    if (now is None) != (seen is None) or (
        now is not None and seen is not None and (now.id, now.state) != (seen.id, seen.state)
    ):
        raise StreamError(f"the history of slot {lock.slot} moved during the gap check: again")


def observe_slot(metrics: RelayMetrics, slot: SlotRow | None) -> None:
    """Set the slot's wal_status (one label 1, the others 0) and safe_wal_size gauges."""
    current = slot.wal_status if slot is not None else "missing"
    for status in ("reserved", "extended", "unreserved", "lost", "missing"):
        metrics.slot_wal_status.labels(status).set(1 if status == current else 0)
    size = slot.safe_wal_size if slot is not None else None
    metrics.slot_safe_wal_size.set(-1 if size is None else size)
