"""The parking lot: table ``failed_sync_events`` (reference design + Kafka origin).

Guarantees:

* one row per event: ``outbox_event_id`` (the idempotency key) is unique, so
  a redelivered or replayed event updates its row instead of adding one;
* a row is written before the sink counts its record as done, so an offset
  never moves past an event that is neither delivered nor parked;
* :meth:`ParkingLot.claim_due` hands a row to one retrier at a time
  (``FOR UPDATE SKIP LOCKED`` and status ``PENDING``), so two sink instances'
  schedulers never retry the same row at once;
* statuses: ``FAILED`` (waiting for its ``next_retry_at``), ``PENDING`` (being
  retried now), ``DONE`` (the engine accepted it).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import psycopg
from psycopg.rows import dict_row

log = logging.getLogger(__name__)


class ParkedStatus(enum.StrEnum):
    FAILED = "FAILED"  # delivery failed; retried when next_retry_at is due
    PENDING = "PENDING"  # claimed by a retrier right now
    DONE = "DONE"  # the engine accepted it on a retry


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


_COLUMNS = (
    "event_id, event_type, payload_json, status, retry_count, last_error, next_retry_at,"
    " created_at, updated_at, outbox_event_id::text AS outbox_event_id, kafka_topic,"
    " kafka_partition, kafka_offset, kafka_key, kafka_headers"
)

_PARK_SQL = """
INSERT INTO failed_sync_events
    (event_type, payload_json, status, retry_count, last_error, next_retry_at,
     outbox_event_id, kafka_topic, kafka_partition, kafka_offset, kafka_key, kafka_headers)
VALUES (%(sync_type)s, %(payload)s, 'FAILED', 0, %(reason)s,
        now() + make_interval(secs => %(retry_in_s)s),
        %(outbox_event_id)s, %(topic)s, %(partition)s, %(offset)s, %(key)s, %(headers)s)
ON CONFLICT (outbox_event_id) DO UPDATE SET
    status = 'FAILED', last_error = EXCLUDED.last_error,
    next_retry_at = EXCLUDED.next_retry_at, updated_at = now(),
    kafka_topic = EXCLUDED.kafka_topic, kafka_partition = EXCLUDED.kafka_partition,
    kafka_offset = EXCLUDED.kafka_offset
RETURNING event_id
"""


def _uuid_or_none(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


class ParkingLot:
    """Async repository of ``failed_sync_events`` over one connection (reconnects)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def _connection(self) -> psycopg.AsyncConnection[dict[str, Any]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, row_factory=dict_row, connect_timeout=10
            )
        return self._conn

    async def _fetch(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        async with self._lock:
            conn = await self._connection()
            try:
                cur = await conn.execute(query, params)
                return await cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                await conn.close()
                raise

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def park(self, req: ParkRequest) -> int:
        """Insert (or refresh) the row of this event; return its ``event_id``."""
        outbox_id = _uuid_or_none(req.outbox_event_id)
        headers = {k: v.decode("utf-8", "replace") for k, v in req.headers.items()}
        rows = await self._fetch(
            _PARK_SQL,
            {
                "sync_type": req.sync_type,
                "payload": (req.payload or b"").decode("utf-8", "replace"),
                "reason": req.reason[:4000],
                "retry_in_s": req.retry_in_s,
                "outbox_event_id": outbox_id,
                "topic": req.topic,
                "partition": req.partition,
                "offset": req.offset,
                "key": req.key.decode("utf-8", "replace") if req.key is not None else None,
                "headers": orjson.dumps(headers).decode(),
            },
        )
        return int(rows[0]["event_id"])

    async def list_open(self, limit: int = 100) -> list[ParkedEvent]:
        """The oldest ``limit`` FAILED/PENDING rows."""
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM failed_sync_events WHERE status IN ('FAILED', 'PENDING')"  # noqa: S608
            " ORDER BY event_id LIMIT %s",
            (limit,),
        )
        return [_row(r) for r in rows]

    async def get(self, ids: list[int]) -> list[ParkedEvent]:
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM failed_sync_events WHERE event_id = ANY(%s)"  # noqa: S608
            " ORDER BY event_id",
            (ids,),
        )
        return [_row(r) for r in rows]

    async def claim(
        self, ids: list[int] | None, *, limit: int, max_attempts: int | None, due_only: bool
    ) -> list[ParkedEvent]:
        """Mark chosen FAILED/PENDING rows PENDING and return them (skipping locked rows).

        ``ids=None`` takes the oldest open rows; ``due_only`` keeps rows whose
        ``next_retry_at`` has passed; ``max_attempts`` keeps rows below it.
        """
        conditions = ["status IN ('FAILED', 'PENDING')"]
        params: dict[str, Any] = {"limit": limit}
        if ids is not None:
            conditions.append("event_id = ANY(%(ids)s)")
            params["ids"] = ids
        if due_only:
            conditions.append("(next_retry_at IS NULL OR next_retry_at <= now())")
        if max_attempts is not None:
            conditions.append("retry_count < %(max_attempts)s")
            params["max_attempts"] = max_attempts
        where = " AND ".join(conditions)
        rows = await self._fetch(
            f"UPDATE failed_sync_events SET status = 'PENDING', updated_at = now()"  # noqa: S608
            f" WHERE event_id IN (SELECT event_id FROM failed_sync_events WHERE {where}"
            f" ORDER BY event_id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
            f" RETURNING {_COLUMNS}",
            params,
        )
        return sorted((_row(r) for r in rows), key=lambda p: p.event_id)

    async def mark_done(self, event_id: int) -> None:
        await self._fetch(
            "UPDATE failed_sync_events SET status = 'DONE', last_error = NULL,"
            " next_retry_at = NULL, updated_at = now() WHERE event_id = %s",
            (event_id,),
        )

    async def mark_failed(self, event_id: int, error: str, *, retry_in_s: float) -> None:
        await self._fetch(
            "UPDATE failed_sync_events SET status = 'FAILED', retry_count = retry_count + 1,"
            " last_error = %s, next_retry_at = now() + make_interval(secs => %s),"
            " updated_at = now() WHERE event_id = %s",
            (error[:4000], retry_in_s, event_id),
        )

    async def release(self, event_id: int) -> None:
        """Back to FAILED without spending an attempt (the engine was down)."""
        await self._fetch(
            "UPDATE failed_sync_events SET status = 'FAILED', updated_at = now()"
            " WHERE event_id = %s AND status = 'PENDING'",
            (event_id,),
        )

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
    )
