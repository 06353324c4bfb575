"""The parking lot: table ``failed_sync_events`` (reference design + Kafka origin).

Guarantees:

* one row per event: ``outbox_event_id`` (the idempotency key) is unique, so
  a redelivered or replayed event updates its row instead of adding one;
  its ``retry_count`` adds the attempts the sink already spent inline; a
  record without an event id is one row per place in Kafka (topic, partition,
  offset: migration 008), so re-reading it finds its row;
* a row without an event id is never delivered (no idempotency key: the
  scheduler never claims it; an operator fixes or discards it);
* a row is written before the sink counts its record as done, so an offset
  never moves past an event that is neither delivered nor parked;
  :meth:`ParkingLot.park_many` writes a batch in one round-trip;
* claims are leases (:mod:`sinks.parking.claims`, whose rules the SQL here carries
  out one statement per transition): a row is retried by one retrier at a
  time, at most once per due time, each attempt counted once, and a crashed
  claimer's lease expires;
* statuses: ``FAILED`` (waiting for its ``next_retry_at``), ``PENDING``
  (claimed: a retrier holds its lease), ``DONE`` (the engine accepted it).

Bounded waits (issue 35: a stuck parking lot never hangs its callers):

* the connection has a connect timeout, TCP keepalives and
  ``tcp_user_timeout`` (a dead path fails it), a server-side
  ``statement_timeout`` and ``lock_timeout`` (a ``LOCK TABLE failed_sync_events``
  held by someone else fails a statement in :attr:`LotTimeouts.lock_ms`), and
  every statement a client-side deadline (a server that stopped answering);
* one statement at a time runs on the connection; a caller waits at most
  :attr:`LotTimeouts.queue_s` for its turn (or, without that bound, as many
  statement deadlines as there are statements ahead of it);
* a statement PostgreSQL refuses for what it carries (a value over a limit, a
  ``statement_timeout``: the same statement fails again) is :class:`ParkRefused`,
  a :class:`ParkingLotUnavailable` that is not ``retriable``;
* every such failure is one :class:`ParkingLotUnavailable` whose message is a
  line for ``/readyz``, an admin API 503 or the CLI: ``parking lot
  unavailable: ...``. A statement cut by ``lock_timeout`` or
  ``statement_timeout`` leaves the connection in use; any other failure
  drops it (the next statement reconnects).

Times default to the database's ``now()`` (one clock for every sink
instance); tests pass ``now`` to drive the clock.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from sinks.core.errors import SinkError
from sinks.core.schedule import retry_delay_s
from sinks.parking.claims import CLAIM_LEASE_S, AttemptResult, RowStatus
from sinks.parking.reasons import REASONS_SHOWN, REASONS_SQL, ReasonCount
from sinks.parking.statements import LIST_NARROWING, PARK_SQL

log = logging.getLogger("sinks.parking")

#: libpq settings of the parking lot's connection unless its DSN sets them: an
#: idle path is probed after 10 s, every 5 s, given up after 3 lost probes; data
#: sent and not acknowledged fails it after 15 s.
KEEPALIVE_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LotTimeouts:
    """The bounds of the parking lot's waits (defaults for production; tests shorten them)."""

    #: libpq's connect_timeout (whole seconds, at least 2): a connect that hangs.
    connect_s: int = 5
    #: Server-side statement_timeout: a park batch of 500 rows takes milliseconds.
    statement_ms: int = 15_000
    #: Server-side lock_timeout: a lock someone else holds longer is their
    #: maintenance, not ours to wait for (the records are parked again later).
    lock_ms: int = 2_000
    #: Client-side bound of one statement (a server that stopped answering, when
    #: its own timeouts cannot fire): statement_timeout plus a margin.
    deadline_s: float = 20.0
    #: Longest wait for the connection while other statements run on it; ``None``:
    #: wait for its turn (each statement ahead is bounded by the deadline) - for a
    #: caller that only queues behind its own statements, as the consumer's parks.
    queue_s: float | None = 5.0

    def options(self) -> str:
        """The ``options`` of the connection: the server-side timeouts."""
        return f"-c statement_timeout={self.statement_ms} -c lock_timeout={self.lock_ms}"


class ParkingLotUnavailable(SinkError):  # noqa: N818 - named after the condition, as its peers
    """The parking lot could not run a statement now; the message is one line.

    ``parking lot unavailable: ...`` names what failed (a lock not granted, a
    timeout, a connection that failed). Nothing was written: try again later.
    """

    retriable = True
    spends_attempt = False

    def __init__(self, what: str) -> None:
        super().__init__(f"parking lot unavailable: {what}")


class ParkRefused(ParkingLotUnavailable):
    """PostgreSQL answered and refused the statement for what it carries - a value over
    a limit, data it cannot take, a ``statement_timeout`` - not an outage: the same
    statement fails again. The consumer splits a refused park batch down to the
    record that causes it (:meth:`sinks.core.machine.SinkCore.park_refused`)."""

    retriable = False


#: SQLSTATEs (or their classes) of an outage: the connection, the server going away or
#: starting, too many connections, a lock held by another session. Any other error
#: PostgreSQL answers with is about the statement (:class:`ParkRefused`).
_OUTAGE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300", "55P03")


def _is_outage(exc: psycopg.Error) -> bool:
    return exc.sqlstate is None or exc.sqlstate.startswith(_OUTAGE_SQLSTATES)


def lot_conninfo(dsn: str, timeouts: LotTimeouts) -> str:
    """``dsn`` with :data:`KEEPALIVE_DEFAULTS`, the connect timeout and the server-side
    timeouts merged in (what the DSN sets wins; its own ``options`` are kept first)."""
    params = conninfo_to_dict(dsn)
    for name, value in KEEPALIVE_DEFAULTS.items():
        params.setdefault(name, value)
    params.setdefault("connect_timeout", str(max(2, timeouts.connect_s)))
    theirs = str(params.get("options") or "")
    params["options"] = f"{timeouts.options()} {theirs}".strip()  # later -c settings win
    return make_conninfo("", **params)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


#: The row statuses (one enum for the rules and the repository).
ParkedStatus = RowStatus


@dataclass(frozen=True, slots=True)
class ParkedEvent:
    """One row of ``failed_sync_events``."""

    event_id: int
    event_type: str
    payload_json: str
    status: str
    retry_count: int
    last_error: str | None
    next_retry_at: datetime | None
    created_at: datetime
    updated_at: datetime
    outbox_event_id: str | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    kafka_key: str | None
    kafka_headers: dict[str, str]
    claimed_by: str | None = None
    claimed_until: datetime | None = None
    routes_fingerprint: str | None = None

    @property
    def type_header(self) -> str:
        """The record's ``type`` header (what routing dispatches on)."""
        return self.kafka_headers.get("type", "")

    def as_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "event_type": self.event_type,
            "payload_json": self.payload_json,
            "status": self.status,
            "retry_count": self.retry_count,
            "last_error": self.last_error,
            "next_retry_at": self.next_retry_at.isoformat() if self.next_retry_at else None,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "outbox_event_id": self.outbox_event_id,
            "kafka_topic": self.kafka_topic,
            "kafka_partition": self.kafka_partition,
            "kafka_offset": self.kafka_offset,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ParkRequest:
    """What the sink knows of a record it must park."""

    outbox_event_id: str | None
    sync_type: str
    payload: bytes | None
    reason: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    retry_in_s: float
    #: Attempts already spent on it (inline): the row's retry_count starts there.
    attempts: int = 0
    #: The routing configuration it was parked under (see sinks.parking.claims).
    routes_fingerprint: str | None = None


_COLUMNS = (
    "event_id, event_type, payload_json, status, retry_count, last_error, next_retry_at,"
    " created_at, updated_at, outbox_event_id::text AS outbox_event_id, kafka_topic,"
    " kafka_partition, kafka_offset, kafka_key, kafka_headers, claimed_by, claimed_until,"
    " routes_fingerprint"
)

#: The clock of a statement: the caller's ``now`` (tests) or the database's.
_NOW = "COALESCE(%(now)s::timestamptz, now())"
#: sinks.parking.claims.claimable: not DONE, no live lease (a PENDING row without one
#: was claimed by a version without leases, or its claimer crashed).
_CLAIMABLE = (
    "status <> 'DONE' AND NOT (status = 'PENDING' AND claimed_until IS NOT NULL"
    f" AND claimed_until > {_NOW})"
)
#: Rows not under a live lease (sinks.parking.claims.lease_live, negated).
_UNLEASED = f"NOT (status = 'PENDING' AND claimed_until IS NOT NULL AND claimed_until > {_NOW})"
_OPEN = (RowStatus.FAILED, RowStatus.PENDING)
#: Filters of list_rows / accept: statuses, a sync type or a type header, ids.
_MATCHING = (
    "status = ANY(%(statuses)s)"
    " AND (%(type)s::text IS NULL OR event_type = %(type)s OR kafka_headers->>'type' = %(type)s)"
    " AND (%(ids)s::bigint[] IS NULL OR event_id = ANY(%(ids)s))"
)


def _matching(
    *, statuses: Sequence[str], event_type: str | None, ids: list[int] | None
) -> dict[str, Any]:
    return {"statuses": [str(s) for s in statuses], "type": event_type, "ids": ids}


#: retry_count is an int4: no row reaches this.
_NO_LIMIT = 2**31 - 1
_DUE = (
    f"(next_retry_at IS NULL OR next_retry_at <= {_NOW}) AND retry_count < %(max_attempts)s"
    " AND outbox_event_id IS NOT NULL"
    " AND NOT (event_type = 'UNROUTABLE'"
    " AND routes_fingerprint IS NOT DISTINCT FROM %(fingerprint)s)"
)


def _uuid_or_none(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


class ParkingLot:
    """Async repository of ``failed_sync_events`` over one connection (reconnects).

    Every wait is bounded by ``timeouts`` (see the module docstring); a statement
    that cannot run raises :class:`ParkingLotUnavailable`.
    """

    def __init__(self, dsn: str, *, timeouts: LotTimeouts | None = None) -> None:
        self.timeouts = timeouts or LotTimeouts()
        self._conninfo = lot_conninfo(dsn, self.timeouts)
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def _connection(self) -> psycopg.AsyncConnection[dict[str, Any]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, row_factory=dict_row
            )
        return self._conn

    async def _fetch(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        timeouts = self.timeouts
        try:
            async with asyncio.timeout(timeouts.queue_s):
                await self._lock.acquire()
        except TimeoutError:
            raise ParkingLotUnavailable(
                f"busy: other statements have held its connection for over {timeouts.queue_s:g} s"
            ) from None
        try:
            async with asyncio.timeout(timeouts.deadline_s):
                conn = await self._connection()
                cur = await conn.execute(query, params)
                return await cur.fetchall() if cur.description else []
        except TimeoutError:
            await self._drop()
            raise ParkingLotUnavailable(
                f"no answer from PostgreSQL within {timeouts.deadline_s:g} s"
            ) from None
        except pgerrors.LockNotAvailable as exc:
            raise ParkingLotUnavailable(
                f"failed_sync_events is locked by another session (lock_timeout"
                f" {timeouts.lock_ms / 1000:g} s)"
            ) from exc
        except pgerrors.QueryCanceled as exc:
            raise ParkRefused(f"statement cancelled: {_first_line(exc)}") from exc
        except psycopg.Error as exc:
            if not _is_outage(exc):  # answered: the statement is refused for what it carries
                raise ParkRefused(f"{type(exc).__name__}: {_first_line(exc)}") from exc
            await self._drop()
            # psycopg's connect keeps the error it raises in locals of its own frame
            # (last_ex, conn_errors), a frame of this traceback: a reference cycle
            # that held this frame - and its params, a park batch's whole JSON
            # document (~250 KiB) - until the cyclic GC ran, which the sink's
            # raised gen-0 threshold makes rare: a paused sink retrying its parks
            # against a PostgreSQL that is away grew by one document per failure.
            exc.__traceback__ = None
            raise ParkingLotUnavailable(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        finally:
            self._lock.release()

    async def _drop(self) -> None:
        """Forget the connection (its state is unknown); the next statement reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        await self._drop()

    async def park(self, req: ParkRequest) -> int:
        """Insert (or refresh) the row of this event; return its ``event_id``."""
        return (await self.park_many([req]))[0]

    async def park_many(self, reqs: list[ParkRequest], *, now: datetime | None = None) -> list[int]:
        """Insert (or refresh) the rows of these events in one statement; return their ids.

        Two requests for the same event in one batch are written once (the last wins).
        """
        latest: dict[object, ParkRequest] = {}
        for req in reqs:
            outbox_id = _uuid_or_none(req.outbox_event_id)
            latest[outbox_id or (req.topic, req.partition, req.offset)] = req
        # One JSON document for the whole batch: encoded in C by orjson, read by
        # jsonb_to_recordset - ~10x cheaper than a text array per column.
        document = orjson.dumps(
            [
                {
                    "sync_type": r.sync_type,
                    "payload": _text(r.payload or b""),
                    "attempts": r.attempts,
                    "reason": _text(r.reason.encode())[:4000],
                    "retry_in_s": r.retry_in_s,
                    "outbox_event_id": _uuid_or_none(r.outbox_event_id),
                    "topic": r.topic,
                    "kafka_partition": r.partition,
                    "kafka_offset": r.offset,
                    "kafka_key": _text(r.key) if r.key is not None else None,
                    "headers": {k: _text(v) for k, v in r.headers.items()},
                    "fingerprint": r.routes_fingerprint,
                }
                for r in latest.values()
            ]
        ).decode()
        rows = await self._fetch(PARK_SQL, {"rows": document, "now": now})
        return [int(r["event_id"]) for r in rows]

    async def list_open(self, limit: int = 100) -> list[ParkedEvent]:
        """The oldest ``limit`` FAILED/PENDING rows."""
        return await self.list_rows(limit=limit)

    async def list_rows(
        self,
        *,
        statuses: Sequence[str] = (RowStatus.FAILED, RowStatus.PENDING),
        event_type: str | None = None,
        limit: int = 100,
        key: str | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        reason_class: str | None = None,
    ) -> list[ParkedEvent]:
        """The oldest ``limit`` rows in ``statuses``, of ``event_type`` if given.

        ``event_type`` matches the row's sync type (``USER_SYNC``, ``UNROUTABLE``
        ...) or the record's ``type`` header (``UserEmailChanged``); ``LIST_NARROWING``
        (statements) says what ``key``, ``reason``, ``reason_class``, ``since``, ``until`` match.
        """
        narrowing = {"key": key, "reason": reason, "since": since, "until": until, "limit": limit}
        narrowing["reason_class"] = reason_class
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM failed_sync_events WHERE {_MATCHING}{LIST_NARROWING}"  # noqa: S608
            " ORDER BY event_id LIMIT %(limit)s",
            _matching(statuses=statuses, event_type=event_type, ids=None) | narrowing,
        )
        return [_row(r) for r in rows]

    async def count_acceptable(self, *, ids: list[int] | None, event_type: str | None) -> int:
        """Rows :meth:`accept` would mark DONE now."""
        rows = await self._fetch(
            f"SELECT count(*) AS n FROM failed_sync_events WHERE {_MATCHING} AND {_UNLEASED}",  # noqa: S608
            _matching(statuses=_OPEN, event_type=event_type, ids=ids) | {"now": None},
        )
        return int(rows[0]["n"])

    async def accept(
        self, *, ids: list[int] | None, event_type: str | None, reason: str | None = None
    ) -> list[int]:
        """Mark open rows DONE without sending them ("accept as skipped"); their ids.

        An operator's decision, recorded in ``last_error`` (with ``reason``, when given);
        a row under a live lease (being retried right now) is left alone.
        """
        said = f" ({reason})" if reason else ""  # (the whole text is cut at 4,000)
        rows = await self._fetch(
            "UPDATE failed_sync_events SET status = 'DONE', next_retry_at = NULL,"  # noqa: S608
            " last_error = left(%(said)s || '; was: '"
            " || coalesce(last_error, ''), 4000),"
            " claimed_by = NULL, claimed_until = NULL, updated_at = now()"
            f" WHERE {_MATCHING} AND {_UNLEASED} RETURNING event_id",
            _matching(statuses=_OPEN, event_type=event_type, ids=ids)
            | {"now": None, "said": "accepted as skipped by an operator" + said},
        )
        return sorted(int(r["event_id"]) for r in rows)

    async def get(self, ids: list[int]) -> list[ParkedEvent]:
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM failed_sync_events WHERE event_id = ANY(%s)"  # noqa: S608
            " ORDER BY event_id",
            (ids,),
        )
        return [_row(r) for r in rows]

    async def claim_next(
        self,
        *,
        by: str,
        scheduled: bool,
        max_attempts: int | None = None,
        fingerprint: str | None = None,
        after_id: int = 0,
        lease_s: float = CLAIM_LEASE_S,
        now: datetime | None = None,
    ) -> ParkedEvent | None:
        """Lease the oldest claimable row after ``after_id``.

        ``scheduled``: only a due row below ``max_attempts``, and an UNROUTABLE
        one only if parked under another routing than ``fingerprint`` (an
        operator's retry_all takes any row without a live lease).
        """
        where = f"{_CLAIMABLE} AND event_id > %(after)s"
        if scheduled:
            where += f" AND {_DUE}"
        return await self._claim(
            where,
            {
                "after": after_id,
                "max_attempts": _NO_LIMIT if max_attempts is None else max_attempts,
                "fingerprint": fingerprint,
            },
            by=by,
            lease_s=lease_s,
            now=now,
        )

    async def claim_id(
        self, event_id: int, *, by: str, lease_s: float = CLAIM_LEASE_S, now: datetime | None = None
    ) -> ParkedEvent | None:
        """Lease row ``event_id`` for an operator's retry; ``None`` when done, unknown or leased."""
        return await self._claim(
            f"{_CLAIMABLE} AND event_id = %(id)s", {"id": event_id}, by=by, lease_s=lease_s, now=now
        )

    async def _claim(
        self,
        where: str,
        params: dict[str, Any],
        *,
        by: str,
        lease_s: float,
        now: datetime | None,
    ) -> ParkedEvent | None:
        rows = await self._fetch(
            "UPDATE failed_sync_events SET status = 'PENDING', claimed_by = %(by)s,"  # noqa: S608
            f" claimed_until = {_NOW} + make_interval(secs => %(lease_s)s), updated_at = now()"
            f" WHERE event_id = (SELECT event_id FROM failed_sync_events WHERE {where}"
            " ORDER BY event_id LIMIT 1 FOR UPDATE SKIP LOCKED)"
            f" RETURNING {_COLUMNS}",
            {**params, "by": by, "lease_s": lease_s, "now": now},
        )
        return _row(rows[0]) if rows else None

    async def settle(
        self,
        row: ParkedEvent,
        *,
        by: str,
        result: AttemptResult,
        error: str | None,
        backoff_base_s: float,
        period_s: float,
        fingerprint: str | None = None,
        now: datetime | None = None,
    ) -> bool:
        """Record ``by``'s attempt on ``row`` (:func:`sinks.parking.claims.settle`).

        False when ``by`` no longer holds the lease: the attempt is not counted.
        """
        params: dict[str, Any] = {"id": row.event_id, "by": by, "now": now, "fp": fingerprint}
        if result is AttemptResult.DELIVERED:
            sets = "status = 'DONE', last_error = NULL, next_retry_at = NULL"
        elif result is AttemptResult.SKIPPED:
            sets = "status = 'DONE', last_error = %(error)s, next_retry_at = NULL"
            params["error"] = (error or "")[:4000]
        elif result is AttemptResult.REJECTED:
            sets = (
                "status = 'FAILED', retry_count = retry_count + 1, last_error = %(error)s,"
                f" next_retry_at = {_NOW} + make_interval(secs => %(delay_s)s)"
            )
            params["error"] = (error or "")[:4000]
            params["delay_s"] = retry_delay_s(row.retry_count + 1, backoff_base_s)
        else:
            sets = f"status = 'FAILED', next_retry_at = {_NOW} + make_interval(secs => %(delay_s)s)"
            params["delay_s"] = period_s
        rows = await self._fetch(
            f"UPDATE failed_sync_events SET {sets}, claimed_by = NULL, claimed_until = NULL,"  # noqa: S608
            " routes_fingerprint = %(fp)s, updated_at = now()"
            " WHERE event_id = %(id)s AND status = 'PENDING' AND claimed_by = %(by)s"
            " RETURNING event_id",
            params,
        )
        return bool(rows)

    async def counts_by_type(self) -> dict[tuple[str, str], int]:
        """Rows per (sync type, status): why they are parked (``UNROUTABLE``: no route for
        their type; ``USER_SYNC``/``QUIZ_SYNC``: the engine would not take them)."""
        rows = await self._fetch(
            "SELECT event_type, status, count(*) AS n FROM failed_sync_events"
            " GROUP BY event_type, status ORDER BY event_type, status"
        )
        return {(str(r["event_type"]), str(r["status"])): int(r["n"]) for r in rows}

    async def counts_by_reason(self, *, limit: int = REASONS_SHOWN) -> list[ReasonCount]:
        """Open rows per reason class, most first (:mod:`sinks.parking.reasons`)."""
        rows = await self._fetch(REASONS_SQL, {"limit": limit})
        return [ReasonCount(str(r["reason"]), int(r["n"])) for r in rows]

    async def counts(self) -> dict[str, int]:
        rows = await self._fetch(
            "SELECT status, count(*) AS n FROM failed_sync_events GROUP BY status"
        )
        out = {s.value: 0 for s in ParkedStatus}
        out.update({r["status"]: int(r["n"]) for r in rows})
        return out


def _row(r: dict[str, Any]) -> ParkedEvent:
    headers = r["kafka_headers"] or {}
    return ParkedEvent(
        event_id=r["event_id"],
        event_type=r["event_type"],
        payload_json=r["payload_json"],
        status=r["status"],
        retry_count=r["retry_count"],
        last_error=r["last_error"],
        next_retry_at=r["next_retry_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        outbox_event_id=r["outbox_event_id"],
        kafka_topic=r["kafka_topic"],
        kafka_partition=r["kafka_partition"],
        kafka_offset=r["kafka_offset"],
        kafka_key=r["kafka_key"],
        kafka_headers={str(k): str(v) for k, v in headers.items()},
        claimed_by=r["claimed_by"],
        claimed_until=r["claimed_until"],
        routes_fingerprint=r["routes_fingerprint"],
    )


def _text(raw: bytes) -> str:
    """Bytes as text for a text column: invalid UTF-8 replaced, NUL (refused by PostgreSQL) too."""
    return raw.decode("utf-8", "replace").replace("\x00", "\ufffd")
