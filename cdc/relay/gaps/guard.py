"""The relay's slot guard: the gap check before every session, the recovery behind it, and the
start-up check of what the last start published.

Guarantees:

* a session streams only after :func:`cdc.relay.gaps.gap.decide` said so, or after
  the slot was made (first start on an empty outbox, ``CDC_SLOT_INIT``) or
  adopted (no identity recorded, nothing against it) and its identity recorded
  in the slot history, or after a gap was closed - recovered from the outbox
  table with every record acknowledged, or the loss accepted by an operator;
  every session then confirms no further than the slot's confirm limit
  (:class:`cdc.relay.gaps.ledger.SlotLedger`);
* a slot another process streams is not inspected (no tail read): the relay
  waits as a standby;
* a gap is recorded (``open`` in the slot history) and recovered only under the
  slot's recovery lock (:mod:`cdc.repair.lock`), after checking that the
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
* **the start-up check** of what the last start published is armed once the
  session's start is known and runs beside the stream (:mod:`.start_check`, under the
  slot's audit lock, :class:`cdc.repair.lock.AuditLock`);
* every slot the guard creates (first start, recovery) is a failover slot when
  ``CDC_FAILOVER_SLOT`` asks for one on this server (auto: PostgreSQL 17+), and a
  slot it streams on is altered to match before the session starts; after a
  failover, the slot the server synchronized to the promoted standby is streamed
  on without a gap (:func:`cdc.relay.gaps.gap.decide`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from cdc import constants as c
from cdc import gaps
from cdc.errors import CdcError, DatabaseSetupError, StreamError
from cdc.evidence import origin_value
from cdc.lineage import LastRecord
from cdc.relay.gaps import recovery
from cdc.relay.gaps.gap import Action, GapCause, Verdict
from cdc.relay.gaps.ledger import SlotLedger
from cdc.relay.gaps.start_check import StartCheck
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.monitor import observe_slot
from cdc.relay.health.state import RelayState
from cdc.repair.lock import RecoveryLock
from cdc.settings import Settings
from cdc.wal.slots import (
    FAILOVER_SLOTS_MIN_VERSION,
    ServerIdentity,
    SlotRow,
    alter_failover,
    failover_wanted,
)

if TYPE_CHECKING:
    from cdc.kafka.producer import TopicManager

log = logging.getLogger("cdc.relay")

#: A relay waiting in `gap` checks the slot and the history again this often.
GAP_RECHECK_S = 5.0


class SlotGapError(CdcError):
    """The slot has a gap the relay does not close by itself: it waits in state ``gap``."""

    retriable = True


class SlotGuard:
    """The relay's gap check at each session's start (a collaborator of
    :class:`~cdc.relay.stream.loop.Relay`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: RelayMetrics,
        stop: threading.Event,
        *,
        topics: TopicManager,
        ledger: SlotLedger,
        set_state: Callable[[RelayState, str], None],
        slot_survives_failover: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._topics = topics
        #: the relay's records of its slot
        self._ledger = ledger
        self._set_state = set_state
        #: the standby-safe mode's answer (:meth:`StandbySafe.slot_survives_failover`)
        self._slot_survives_failover = slot_survives_failover
        #: the start-up check (once per process)
        self._start_check = StartCheck(settings, metrics, stop)
        #: slot gaps already logged and counted (each is reported once)
        self._gaps_reported: set[int] = set()
        self._refusal_reported = False
        #: the relay's newest own record the last session's tail read found (the
        #: evidence an exactly-once checkpoint is judged by)
        self.last_record: LastRecord | None = None

    def _arm_start_check(
        self,
        last: LastRecord | None,
        server: ServerIdentity,
        origin: str,
        start_lsn: str,
        start_at: datetime,
        since: datetime | None,
    ) -> None:
        """The session's start is known: arm the start-up check (:mod:`.start_check`)."""
        self.last_record = last
        self._start_check.arm(last, server, origin, start_lsn, start_at, since)

    def guard_slot(self) -> tuple[str, bytes]:
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


def _check_history_unmoved(lock: RecoveryLock, found: recovery.Inspection) -> None:
    """Under the recovery lock: the slot history is as the gap check saw it (else another
    process recorded or closed a gap meanwhile, and the check is done again)."""
    now = gaps.latest(lock.checked(), lock.slot)
    seen = found.history
    if (now is None) != (seen is None) or (
        now is not None and seen is not None and (now.id, now.state) != (seen.id, seen.state)
    ):
        raise StreamError(f"the history of slot {lock.slot} moved during the gap check: again")
