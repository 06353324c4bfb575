"""The application side: write outbox events inside the caller's transaction.

Guarantees:

* :func:`write_event` inserts one outbox row using the caller's connection and
  open transaction, so the event commits or rolls back together with the
  business row; it refuses an autocommit connection outside a transaction
  block, where the event would commit on its own;
* with ``delete_after=True`` the row is deleted again in the same transaction:
  the insert still reaches the WAL (and so the relay) but the table stays empty;
* :func:`emit_event` is the table-less variant: a transactional
  ``pg_logical_emit_message(true, 'outbox', <json>)`` carrying the same fields;
* :func:`register_user` and :func:`submit_quiz_attempt` are the demo domain's
  operations, each one transaction holding the business row and its event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from cdc.constants import OUTBOX_MESSAGE_PREFIX
from cdc.errors import CdcError

Conn = psycopg.Connection[Any]

USER_AGGREGATE = "user"
USER_REGISTERED = "UserRegistered"
QUIZ_AGGREGATE = "quiz_attempt"
QUIZ_ATTEMPT_SUBMITTED = "QuizAttemptSubmitted"


class OutboxUsageError(CdcError):
    """The outbox was written outside a transaction that would carry it."""


@dataclass(frozen=True, kw_only=True)
class OutboxEvent:
    """One event as the application states it."""

    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Mapping[str, Any]
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)
    #: W3C traceparent, forwarded as the Kafka header ``traceparent``.
    traceparent: str | None = None

    def message_json(self) -> str:
        """The JSON body of the table-less (logical message) form."""
        return json.dumps(
            {
                "id": str(self.event_id),
                "aggregatetype": self.aggregate_type,
                "aggregateid": self.aggregate_id,
                "type": self.event_type,
                "payload": self.payload,
                "tracingspancontext": self.traceparent,
            },
            separators=(",", ":"),
            default=str,
        )


def _require_transaction(conn: Conn) -> None:
    status = conn.info.transaction_status
    if conn.autocommit and status == TransactionStatus.IDLE:
        raise OutboxUsageError(
            "outbox event written on an autocommit connection outside a transaction: "
            "wrap the business write and the event in `with conn.transaction():`"
        )
    if status == TransactionStatus.INERROR:
        raise OutboxUsageError("the caller's transaction has already failed")


def write_event(
    conn: Conn, event: OutboxEvent, *, table: str = "outbox", delete_after: bool = False
) -> uuid.UUID:
    """Insert ``event`` into the outbox inside the caller's transaction."""
    _require_transaction(conn)
    ident = table_identifier(table)
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, tracingspancontext)"
            " VALUES (%s, %s, %s, %s, %s, %s)"
        ).format(ident),
        (
            event.event_id,
            event.aggregate_type,
            event.aggregate_id,
            event.event_type,
            Jsonb(event.payload, dumps=_dumps),
            event.traceparent,
        ),
    )
    if delete_after:
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(ident), (event.event_id,))
    return event.event_id


def table_identifier(table: str) -> sql.Identifier:
    """``table`` or ``schema.table`` as a quoted SQL identifier."""
    return sql.Identifier(*table.split(".", 1))


def emit_event(conn: Conn, event: OutboxEvent) -> uuid.UUID:
    """Emit ``event`` as a transactional logical message (no table involved)."""
    _require_transaction(conn)
    conn.execute(
        "SELECT pg_logical_emit_message(true, %s, %s)",
        (OUTBOX_MESSAGE_PREFIX, event.message_json()),
    )
    return event.event_id


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Written:
    """What a demo operation committed: the business id and the event id."""

    entity_id: uuid.UUID
    event_id: uuid.UUID


def register_user(
    conn: Conn, *, email: str, display_name: str, delete_after: bool = False
) -> Written:
    """Insert a user and its ``UserRegistered`` event in one transaction."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO users (email, display_name) VALUES (%s, %s) RETURNING id, registered_at",
            (email, display_name),
        ).fetchone()
        assert row is not None
        user_id, registered_at = row
        event_id = write_event(
            conn,
            user_registered_event(user_id, email, display_name, registered_at),
            delete_after=delete_after,
        )
    return Written(user_id, event_id)


def user_registered_event(
    user_id: uuid.UUID, email: str, display_name: str, registered_at: datetime
) -> OutboxEvent:
    """The ``UserRegistered`` event of a user (also used by the resync backfill)."""
    return OutboxEvent(
        aggregate_type=USER_AGGREGATE,
        aggregate_id=str(user_id),
        event_type=USER_REGISTERED,
        payload={
            "user_id": str(user_id),
            "email": email,
            "display_name": display_name,
            "registered_at": registered_at.isoformat(),
        },
    )


def submit_quiz_attempt(
    conn: Conn, *, user_id: uuid.UUID, quiz_id: str, score: int, delete_after: bool = False
) -> Written:
    """Insert a quiz attempt and its ``QuizAttemptSubmitted`` event in one transaction.

    The event's aggregate id is the *user* id so that one user's attempts keep
    their order on one Kafka partition.
    """
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO quiz_attempts (user_id, quiz_id, score) VALUES (%s, %s, %s)"
            " RETURNING id, submitted_at",
            (user_id, quiz_id, score),
        ).fetchone()
        assert row is not None
        attempt_id, submitted_at = row
        event = OutboxEvent(
            aggregate_type=QUIZ_AGGREGATE,
            aggregate_id=str(user_id),
            event_type=QUIZ_ATTEMPT_SUBMITTED,
            payload={
                "attempt_id": str(attempt_id),
                "user_id": str(user_id),
                "quiz_id": quiz_id,
                "score": score,
                "submitted_at": submitted_at.isoformat(),
            },
        )
        event_id = write_event(conn, event, delete_after=delete_after)
    return Written(attempt_id, event_id)


@dataclass(frozen=True)
class Retention:
    """What :func:`prune_outbox` must keep (see :mod:`cdc.retention`, which builds it).

    * rows younger than ``horizon_s`` (what a gap recovery may need to re-read);
    * with ``slot``: rows whose inserting transaction is not older than the slot's
      ``catalog_xmin`` - those may have committed after its confirmed position,
      i.e. not be in Kafka yet (a slot without ``catalog_xmin`` keeps every row);
    * with ``keep_since``: rows created at or after it (an open gap's window, or
      the last record found in Kafka minus the gap margin).
    """

    horizon_s: float = 0.0
    slot: str | None = None
    keep_since: datetime | None = None


def prune_outbox(
    conn: Conn,
    *,
    older_than_s: float,
    table: str = "outbox",
    batch_size: int = 10_000,
    keep: Retention | None = None,
) -> int:
    """Delete outbox rows older than ``older_than_s`` that ``keep`` does not keep; how many.

    The relay reads inserts from the WAL, but a slot gap is recovered from the
    table: ``keep`` (``outbox-cdc prune`` always passes one) keeps what a
    recovery may need. Deletes in batches so no transaction holds many row locks.
    """
    keep = keep or Retention()
    total = 0
    stmt = sql.SQL(
        "DELETE FROM {t} WHERE id IN (SELECT id FROM {t}"
        " WHERE created_at < now() - make_interval(secs => %(age)s)"
        " AND (%(since)s::timestamptz IS NULL OR created_at < %(since)s::timestamptz)"
        " AND (%(slot)s::text IS NULL OR age(xmin) > (SELECT age(catalog_xmin)"
        " FROM pg_replication_slots WHERE slot_name = %(slot)s::text))"
        " LIMIT %(limit)s)"
    ).format(t=table_identifier(table))
    params = {
        "age": max(older_than_s, keep.horizon_s),
        "since": keep.keep_since,
        "slot": keep.slot,
        "limit": batch_size,
    }
    while True:
        with conn.transaction():
            deleted = conn.execute(stmt, params).rowcount
        total += max(deleted, 0)
        if deleted < batch_size:
            return total
