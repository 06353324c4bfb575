"""Looking at a walsender, and ending it, over an ordinary connection within a deadline.

Guarantees: :func:`look_at_walsender` and :func:`end_walsender` each answer within the
timeout they are given, connecting included (:func:`cdc.pgconn.rows_within`): behind a
path that passes nothing - where a look is most needed - they fail in time instead of
hanging the relay's loop (the silence detector, :mod:`cdc.relay.health.silence`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg

from cdc.pgconn import rows_within
from cdc.wal.replproto import str_to_lsn

log = logging.getLogger("cdc.stream")


def end_walsender(dsn: str, slot: str, pid: int, timeout_s: float) -> bool:
    """End the walsender ``pid`` if it still holds ``slot``; whether one was ended
    (within ``timeout_s``, connecting included).

    ``dsn`` reaches the server the walsender runs on. For a replication connection
    the relay gave up (its path is dead): behind a half-open path (and with
    ``wal_sender_timeout`` off) the server keeps that walsender, and so the slot,
    until it hears of the end; a new session would find the slot busy. Only our own
    abandoned walsender is ended (slot and pid must match). Behind a path that passes
    nothing this fails: the orphan is taken back by the next session.
    """
    try:
        rows = rows_within(
            dsn,
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
            " WHERE slot_name = $1 AND active_pid = $2::int",
            [slot, str(pid)],
            timeout_s,
        )
    except psycopg.Error as exc:
        log.warning("could not end the walsender %d of slot %s: %s", pid, slot, exc)
        return False
    return bool(rows and rows[0][0] == "t")


@dataclass(frozen=True)
class WalsenderSample:
    """What the server shows of a walsender at one moment (for the silence decision)."""

    #: when it was taken (monotonic seconds)
    at_s: float
    #: the walsender still exists
    found: bool
    #: pg_stat_activity.state (``active`` while it streams)
    state: str | None = None
    wait_event_type: str | None = None
    wait_event: str | None = None
    #: pg_stat_replication.sent_lsn: how far it has read WAL
    sent_lsn: int | None = None
    #: pg_stat_replication_slots total_bytes + spill_bytes of its slot (decoded so far)
    decoded_bytes: int | None = None
    #: pg_stat_replication.reply_time: the send time (the relay's clock, Unix
    #: microseconds) of the last status update the walsender read from the relay
    reply_time_us: int | None = None


_LOOK_SQL = (
    "SELECT a.state, a.wait_event_type, a.wait_event, r.sent_lsn::text,"
    " (SELECT st.total_bytes + st.spill_bytes FROM pg_stat_replication_slots st"
    "  WHERE st.slot_name = $1),"
    " (extract(epoch FROM r.reply_time) * 1000000)::bigint"
    " FROM pg_stat_activity a LEFT JOIN pg_stat_replication r ON r.pid = a.pid"
    " WHERE a.pid = $2::int"
)


def look_at_walsender(dsn: str, slot: str, pid: int, timeout_s: float) -> WalsenderSample:
    """The walsender ``pid`` of ``slot`` as the server (``dsn``) shows it now, read over
    an ordinary connection within ``timeout_s`` (connecting included); raises
    :class:`psycopg.Error` when it cannot be read in time."""
    rows = rows_within(dsn, _LOOK_SQL, [slot, str(pid)], timeout_s)
    now = time.monotonic()
    if not rows:
        return WalsenderSample(at_s=now, found=False)
    state, wait_type, wait_event, sent, decoded, reply_us = rows[0]
    return WalsenderSample(
        at_s=now,
        found=True,
        state=state,
        wait_event_type=wait_type,
        wait_event=wait_event,
        sent_lsn=str_to_lsn(sent) if sent else None,
        decoded_bytes=None if decoded is None else int(decoded),
        reply_time_us=None if reply_us is None else int(reply_us),
    )
