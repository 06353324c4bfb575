"""The relay's slot guard: the gap check before every session, and the recovery behind it.

Guarantees:

* a session streams only after :func:`cdc.relay.gap.decide` said so, or after
  the slot was created at a first start (recorded in the slot history), or
  after a gap was closed - recovered from the outbox table with every record
  acknowledged, or the loss accepted by an operator;
* a gap is logged once (per gap) at ERROR, saying what happened and what the
  relay will do, counted in ``outbox_relay_gaps_total{cause}``; the relay is in
  state ``gap`` (``/readyz`` 503 ``gap: <cause>: <detail>``) until it is closed;
* ``CDC_GAP_RECOVERY=manual``, or a gap the table cannot replay, keeps the relay
  in ``gap``: it checks again every :data:`GAP_RECHECK_S` and goes on once an
  operator ran ``outbox-cdc slot recover --execute`` or ``slot accept-gap``;
* every slot the guard creates (first start, recovery) is a failover slot when
  ``CDC_FAILOVER_SLOT`` asks for one on this server (auto: PostgreSQL 17+), and a
  slot it streams on is altered to match before the session starts; after a
  failover, the slot the server synchronized to the promoted standby is streamed
  on without a gap (:func:`cdc.relay.gap.decide`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cdc import constants as c
from cdc import gaps
from cdc.errors import CdcError, DatabaseSetupError, StreamError
from cdc.lineage import origin_value
from cdc.relay import recovery
from cdc.relay.gap import Action
from cdc.relay.metrics import RelayMetrics
from cdc.relay.state import RelayState
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.slots import FAILOVER_SLOTS_MIN_VERSION, SlotRow, alter_failover, failover_wanted
from cdc.wal.stream import ensure_slot

if TYPE_CHECKING:
    from cdc.producer import TopicManager

log = logging.getLogger("cdc.relay")

#: A relay waiting in `gap` checks the slot and the history again this often.
GAP_RECHECK_S = 5.0


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

        def _set_state(self, state: RelayState, reason: str = "") -> None: ...

    def _guard_slot(self) -> tuple[str, bytes]:
        """Check the slot; create it (first start) or close a gap; the session's
        ``origin`` header. Raises :class:`SlotGapError` while a gap stays open."""
        s = self.settings
        found = recovery.inspect(s, slot_survives_failover=self._slot_survives_failover())
        self._observe_slot(found.slot)
        verdict = found.verdict
        origin = origin_value(found.server, s.slot)
        if verdict.action is Action.CREATE:
            with recovery.connect(s) as conn:
                info = ensure_slot(conn, s.slot, failover=s.failover_slot)
                gaps.record_created(
                    conn, s.slot, origin=origin, consistent_lsn=lsn_to_str(info.confirmed_flush_lsn)
                )
            log.info("first start: slot %s created (no record of it in Kafka)", s.slot)
        elif verdict.action is Action.GAP:
            origin = self._close_gap(recovery.open_gap(s, found))
        elif found.slot is not None:
            self._match_failover(found.slot)
        return (c.HEADER_ORIGIN, origin.encode())

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

    def _close_gap(self, gap: gaps.HistoryRow) -> str:
        s = self.settings
        reason = f"{gap.cause}: {gap.detail}"
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
        done = recovery.recover(s, gap, topics=self._topics)
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


def observe_slot(metrics: RelayMetrics, slot: SlotRow | None) -> None:
    """Set the slot's wal_status (one label 1, the others 0) and safe_wal_size gauges."""
    current = slot.wal_status if slot is not None else "missing"
    for status in ("reserved", "extended", "unreserved", "lost", "missing"):
        metrics.slot_wal_status.labels(status).set(1 if status == current else 0)
    size = slot.safe_wal_size if slot is not None else None
    metrics.slot_safe_wal_size.set(-1 if size is None else size)
