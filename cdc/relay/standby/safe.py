"""The relay's standby-safe mode: records held until a physical standby has their commit.

Guarantees, with ``CDC_STANDBY_SAFE`` naming a physical standby (its
``application_name`` in ``pg_stat_replication`` or its physical slot):

* no record reaches Kafka before that standby flushed the commit of its
  transaction (the decisions are :mod:`cdc.relay.standby.gate`'s), so an event
  a consumer has seen survives the standby's promotion;
* the standby's flushed position is read on a PostgreSQL connection of its own,
  on a thread (every ``CDC_STANDBY_SAFE_POLL_S`` while something is held), never
  on the replication connection: the WAL reading loop never waits for it, it
  looks at the last value once per turn (:meth:`StandbySafe.release_held`);
* held records were added to the LSN tracker before they were held, so they
  count in flight: ``CDC_MAX_IN_FLIGHT`` bounds them (back-pressure), and the
  slot is confirmed past them only after Kafka acknowledged them;
* a standby that has not flushed a held transaction for
  ``CDC_STANDBY_SAFE_MAX_WAIT_S`` makes the relay HELD (no WAL read, ``/readyz``
  503 naming the standby) until it catches up; an unknown position (standby
  not connected, side connection lost) releases nothing;
* PostgreSQL 17+ (unless ``CDC_FAILOVER_SLOT=off``): when the slot is a failover
  slot and the standby's physical slot is in the primary's
  ``synchronized_standby_slots``, the server guards (its walsender sends nothing
  that standby has not confirmed) and held transactions are released at their
  commit, without polling; otherwise the relay's own gate guards (never less
  safe than asked). Checked when the poller connects and every
  :data:`SERVER_GUARD_RECHECK_S`; ``CDC_STANDBY_SAFE_FAILOVER_SLOTS`` is no
  longer needed for it (deprecated);
* a gap recovery (:mod:`cdc.relay.gaps.recovery`) publishes rows of its snapshot only
  after the standby flushed the snapshot's consistent point
  (:func:`wait_standby_flushed`);
* off (the default) costs nothing: the hot path is untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from prometheus_client import CollectorRegistry, Gauge
from psycopg.conninfo import make_conninfo

from cdc.errors import CdcError
from cdc.pgconn import connect
from cdc.relay.health.state import Headers, RefusedStep, SendStep, Session
from cdc.relay.standby.gate import (
    FAILOVER_SLOTS_MIN_VERSION,
    SafeMode,
    StandbyGate,
    choose_mode,
    listed_in_synchronized_standby_slots,
)
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str, str_to_lsn
from cdc.wal.slots import alter_failover_command

log = logging.getLogger("cdc.relay")

#: A held record: topic, value, key, headers, timestamp_ms, event_id (``_send``'s order).
HeldRecord = tuple[str, bytes, bytes, Headers, int, bytes]

#: The standby's flushed position: from the walsender of that application_name, or the
#: physical slot of that name (restart_lsn of a physical slot is what the standby flushed).
#: The third column says whether the reading belongs to the relay's session: its walsender
#: (``pid``) streams on this very server. LSNs of another server (a promoted standby, while
#: the session still holds the old primary's transactions) are never compared with its commits.
FLUSHED_SQL = (
    "SELECT greatest("
    " (SELECT max(flush_lsn) FROM pg_stat_replication WHERE application_name = %(name)s),"
    " (SELECT restart_lsn FROM pg_replication_slots"
    "  WHERE slot_name = %(name)s AND slot_type = 'physical'))::text,"
    " pg_current_wal_lsn()::text,"
    " EXISTS (SELECT 1 FROM pg_stat_replication WHERE pid = %(pid)s)"
)

#: The same, for a gap recovery: on the server that holds the slot it just made.
FLUSHED_SQL_SLOT = FLUSHED_SQL.replace(
    "pg_stat_replication WHERE pid = %(pid)s", "pg_replication_slots WHERE slot_name = %(slot)s"
)

#: The server a session streams from: host, hostaddr, port, its walsender's pid.
Target = tuple[str, str, int, int]

#: While nothing is held, the position is still read this often (for the lag gauge).
IDLE_POLL_S = 1.0

#: After the side connection failed, wait this long before connecting again.
RECONNECT_S = 1.0

#: How often the server's guard (PostgreSQL 17 failover slots) is checked again.
SERVER_GUARD_RECHECK_S = 30.0


class StandbyMetrics:
    """The mode's gauges (in the relay's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Gauge(
            "outbox_relay_standby_lag_bytes",
            "pg_current_wal_lsn() - the standby's flushed LSN (-1: unknown)",
            registry=registry,
        )
        self.held_transactions = Gauge(
            "outbox_relay_standby_held_transactions",
            "Transactions held until the standby flushed their commit",
            registry=registry,
        )
        self.held_records = Gauge(
            "outbox_relay_standby_held_records",
            "Records held until the standby flushed their transaction's commit",
            registry=registry,
        )
        self.mode = Gauge(
            "outbox_relay_standby_safe_mode",
            "1 for the mechanism guarding against phantoms: off, relay or server",
            ["mode"],
            registry=registry,
        )
        self.lag.set(-1)


@dataclass(eq=False)
class _Safe:
    """The mode's state, shared by the loop (holds, releases) and the poller (positions)."""

    standby: str
    gate: StandbyGate[HeldRecord]
    metrics: StandbyMetrics
    #: the producer step the records go to once released (Producing.send)
    publish: SendStep
    #: the session the gate holds records for (a new session clears it)
    sess: Session | None = None
    #: the server the standby's flushed LSN was read on, and that LSN (None: unknown),
    #: replaced as one tuple so the loop never pairs one server's LSN with another server
    reading: tuple[Target | None, int | None] = (None, None)
    #: the session's server (set by the loop for the poller)
    target: Target | None = None
    target_sess: Session | None = None
    mode: SafeMode = SafeMode.RELAY
    thread: threading.Thread | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    #: the HELD reason this mode set on the session (None: it set none)
    held_reason: str | None = None


class StandbySafe:
    """The relay's standby-safe mode (a collaborator of
    :class:`~cdc.relay.stream.loop.Relay`): with ``CDC_STANDBY_SAFE`` set,
    :meth:`hold` is the at-least-once mode's record step (records wait for the
    standby, then go to ``publish``: :meth:`Producing.send`); off, it holds nothing."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        stop: threading.Event,
        *,
        publish: SendStep,
        refused: RefusedStep,
    ) -> None:
        self.settings = settings
        self._stop = stop
        self._refused = refused
        self._safe: _Safe | None = None
        standby = settings.standby_safe
        if standby:
            metrics = StandbyMetrics(registry)
            metrics.mode.labels(SafeMode.RELAY.value).set(1)
            self._safe = _Safe(standby, StandbyGate(), metrics, publish)

    @property
    def on(self) -> bool:
        """Whether the mode is on (``CDC_STANDBY_SAFE`` names a standby)."""
        return self._safe is not None

    def hold(
        self,
        sess: Session,
        tx_id: int,
        topic: str,
        value: bytes,
        key: bytes,
        headers: Headers,
        timestamp_ms: int,
        event_id: bytes,
    ) -> None:
        """Hold one record (already added to the tracker) until the standby has its commit."""
        safe = self._safe
        assert safe is not None
        if safe.sess is not sess:  # a new session: the old one's records were never sent
            safe.gate.clear()
            safe.sess = sess
            safe.held_reason = None
        gate = safe.gate
        gate.hold(tx_id, (topic, value, key, headers, timestamp_ms, event_id), time.monotonic())
        if gate.records == 1:
            safe.wake.set()

    def release_held(self, sess: Session) -> None:
        """Once per loop turn: hand Kafka the held transactions the standby has made safe."""
        safe = self._safe
        if safe is None:
            return
        if safe.thread is None:
            safe.thread = threading.Thread(
                target=self._poll_standby, name="standby-safe", daemon=True
            )
            safe.thread.start()
        gate = safe.gate
        if safe.target_sess is not sess:  # the poller reads the standby on this server now
            safe.target = (*sess.stream.server, sess.stream.backend_pid)
            safe.target_sess = sess
            safe.wake.set()
        if safe.sess is sess and gate.transactions:
            end_lsn_of = sess.tracker.end_lsn
            on, flushed = safe.reading
            if safe.mode is SafeMode.SERVER:
                released = gate.release_all_committed(end_lsn_of)
            else:
                released = gate.release(flushed if on == safe.target else None, end_lsn_of)
            for tx in released:
                for record in tx.records:
                    self._publish_held(safe, sess, tx.tx_id, record)
            sess.reports = None  # (their delivery reports count from now on)
        self._judge_wait(safe, sess)
        safe.metrics.held_transactions.set(gate.transactions if safe.sess is sess else 0)
        safe.metrics.held_records.set(gate.records if safe.sess is sess else 0)

    def slot_survives_failover(self) -> bool:
        """The slot guard's question (:mod:`cdc.relay.gaps.guard`): True only while the server
        guards (PostgreSQL 17+: the slot is a failover slot, the standby listed in
        ``synchronized_standby_slots``), so the slot found on a promoted standby is trusted.
        Until the poller has seen that, False: a gap is recovered (duplicates, no loss)."""
        safe = self._safe
        return safe is not None and safe.mode is SafeMode.SERVER

    def held_records(self, sess: Session) -> int:
        """Records of ``sess`` held for the standby (never sent; counted in flight)."""
        safe = self._safe
        return safe.gate.records if safe is not None and safe.sess is sess else 0

    def _publish_held(self, safe: _Safe, sess: Session, tx_id: int, record: HeldRecord) -> None:
        topic, value, key, headers, timestamp_ms, event_id = record
        try:
            safe.publish(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)
        except KafkaException as exc:
            self._refused(sess, tx_id, exc, topic, key, value, headers, timestamp_ms)

    def _judge_wait(self, safe: _Safe, sess: Session) -> None:
        """HELD (no WAL read, 503) while the oldest held transaction waits too long."""
        oldest = safe.gate.oldest_held_at_s() if safe.sess is sess else None
        waited_s = 0.0 if oldest is None else time.monotonic() - oldest
        if waited_s > self.settings.standby_safe_max_wait_s and safe.mode is SafeMode.RELAY:
            on, flushed = safe.reading
            where = "unknown" if flushed is None or on != safe.target else lsn_to_str(flushed)
            reason = (
                f"waiting {waited_s:.0f}s for standby {safe.standby!r} to flush "
                f"{safe.gate.transactions} held transactions (its flushed LSN: {where})"
            )
            if sess.held is None or sess.held is safe.held_reason:
                if safe.held_reason is None:
                    log.warning("relay held: %s", reason)
                sess.held = safe.held_reason = reason
        elif safe.held_reason is not None:
            if sess.held is safe.held_reason:
                sess.held = None
            safe.held_reason = None
            log.info("standby %s caught up: publishing again", safe.standby)

    # -- the poller thread -------------------------------------------------------------

    def _poll_standby(self) -> None:
        """Read the standby's flushed LSN on a connection of its own, to the server the
        session streams from (never another one of a multi-host DSN), until stopped."""
        safe = self._safe
        assert safe is not None
        last_error = ""
        while not self._stop.is_set():
            target = safe.target
            if target is None:
                safe.wake.wait(IDLE_POLL_S)
                safe.wake.clear()
                continue
            host, hostaddr, port, _ = target
            dsn = make_conninfo(
                self.settings.pg_dsn.get_secret_value(),
                host=host,
                hostaddr=hostaddr,
                port=port,
                target_session_attrs="any",
            )
            try:
                with connect(dsn) as conn:
                    last_error = ""
                    self._poll_on(safe, conn, target)
            except psycopg.Error as exc:
                safe.reading = (None, None)  # unknown: nothing is released
                safe.metrics.lag.set(-1)
                if str(exc) != last_error:
                    log.warning("standby-safe: reading standby %s: %s", safe.standby, exc)
                    last_error = str(exc)
                self._stop.wait(RECONNECT_S)

    def _poll_on(self, safe: _Safe, conn: psycopg.Connection[Any], target: Target) -> None:
        next_guard_check = 0.0
        while not self._stop.is_set() and safe.target == target:
            now = time.monotonic()
            if now >= next_guard_check:
                self._choose_mode(safe, conn)
                next_guard_check = now + SERVER_GUARD_RECHECK_S
            row = conn.execute(FLUSHED_SQL, {"name": safe.standby, "pid": target[3]}).fetchone()
            assert row is not None
            flushed = str_to_lsn(row[0]) if row[0] and row[2] else None
            safe.reading = (target, flushed)
            current = str_to_lsn(row[1])
            safe.metrics.lag.set(-1 if flushed is None else max(current - flushed, 0))
            if safe.gate.records:
                self._stop.wait(self.settings.standby_safe_poll_s)
            else:
                safe.wake.wait(IDLE_POLL_S)
                safe.wake.clear()

    def _choose_mode(self, safe: _Safe, conn: psycopg.Connection[Any]) -> None:
        """The relay's gate, or the server's (PostgreSQL 17 failover slots) when asked and ready."""
        s = self.settings
        row = conn.execute("SHOW server_version_num").fetchone()
        version = int(row[0]) if row else 0
        choice = choose_mode(
            s.standby_safe, failover_slot=s.failover_slot, server_version_num=version
        )
        mode = choice.mode
        if mode is SafeMode.SERVER and not self._server_guards(conn):
            mode = SafeMode.RELAY
        if choice.note and mode is not safe.mode:
            log.warning("standby-safe: %s", choice.note)
        if mode is not safe.mode:
            log.info("standby-safe: %s guards (standby %s)", mode.value, s.standby_safe)
            safe.metrics.mode.labels(safe.mode.value).set(0)
            safe.metrics.mode.labels(mode.value).set(1)
            safe.mode = mode

    def _server_guards(self, conn: psycopg.Connection[Any]) -> bool:
        """PostgreSQL 17+: True when the server guards - the slot is a failover slot (the
        relay's slot guard made it one at the session's start, ``CDC_FAILOVER_SLOT``) and
        the primary's ``synchronized_standby_slots`` names the standby."""
        s = self.settings
        row = conn.execute("SHOW synchronized_standby_slots").fetchone()
        if not listed_in_synchronized_standby_slots(str(row[0]) if row else "", s.standby_safe):
            log.info(
                "standby-safe: %s is not in synchronized_standby_slots, so the relay guards"
                " (ALTER SYSTEM SET synchronized_standby_slots = '%s' lets the server guard)",
                s.standby_safe,
                s.standby_safe,
            )
            return False
        row = conn.execute(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (s.slot,)
        ).fetchone()
        return bool(row and row[0])  # not created yet, or not a failover slot: the relay


class StandbyBehindError(CdcError):
    """The standby did not flush what was about to be published in time; try again later."""

    retriable = True


def wait_standby_flushed(settings: Settings, lsn: int) -> None:
    """Block until the standby-safe standby has flushed ``lsn`` (a gap recovery waits so
    for its snapshot's consistent point before publishing rows of it); raise
    :class:`StandbyBehindError` after ``CDC_STANDBY_SAFE_MAX_WAIT_S``."""
    deadline = time.monotonic() + settings.standby_safe_max_wait_s
    with connect(settings.pg_dsn.get_secret_value()) as conn:
        while True:
            row = conn.execute(
                FLUSHED_SQL_SLOT, {"name": settings.standby_safe, "slot": settings.slot}
            ).fetchone()
            flushed = str_to_lsn(row[0]) if row and row[0] and row[2] else None
            if flushed is not None and flushed >= lsn:
                return
            if time.monotonic() > deadline:
                where = "unknown" if flushed is None else lsn_to_str(flushed)
                raise StandbyBehindError(
                    f"standby {settings.standby_safe!r} has not flushed {lsn_to_str(lsn)} "
                    f"(its flushed LSN: {where}) within {settings.standby_safe_max_wait_s:.0f}s"
                )
            time.sleep(settings.standby_safe_poll_s)


__all__ = [
    "FAILOVER_SLOTS_MIN_VERSION",
    "StandbyBehindError",
    "StandbySafe",
    "alter_failover_command",
    "wait_standby_flushed",
]
