"""The idempotent consumer's tables: the processed-events ledger and the parking table.

Guarantees:

* :func:`ensure_ledger` creates both tables (idempotent; several instances may
  start at once: an advisory lock serialises them);
* :class:`Ledger` writes inside the caller's transaction only: a ledger row
  commits with the handler's writes or not at all;
* a parked row keeps the record byte for byte (key, value, every header in
  order with its null values); text columns never receive a NUL (PostgreSQL
  refuses one), so no record can make parking itself fail;
* :func:`prune_ledger` deletes in batches, each its own transaction.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from cdc.outbox import table_identifier
from sinks.core.delivery import Envelope
from sinks.idempotent.constants import (
    DDL_LOCK_KEY,
    DEFAULT_LEDGER_TABLE,
    DEFAULT_PARKING_TABLE,
    MAX_REASON_CHARS,
    PRUNE_BATCH,
)
from sinks.idempotent.errors import ConsumerUsageError

Conn = psycopg.Connection[Any]

_LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS {ledger} (
    consumer_name text        NOT NULL,
    event_id      text        NOT NULL,
    outcome       text        NOT NULL CHECK (outcome IN ('handled', 'parked', 'dead_lettered')),
    topic         text        NOT NULL,
    "partition"   integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX IF NOT EXISTS {ledger_idx} ON {ledger} (processed_at);
CREATE TABLE IF NOT EXISTS {parking} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name  text        NOT NULL,
    event_id       text        NULL,
    topic          text        NOT NULL,
    "partition"    integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    record_key     bytea       NULL,
    record_value   bytea       NULL,
    header_names   text[]      NOT NULL,
    header_values  bytea[]     NOT NULL,
    timestamp_ms   bigint      NULL,
    reason         text        NOT NULL,
    attempts       integer     NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer_name, topic, "partition", "offset")
)
"""


def ensure_ledger(
    conn: Conn,
    *,
    ledger_table: str = DEFAULT_LEDGER_TABLE,
    parking_table: str = DEFAULT_PARKING_TABLE,
) -> None:
    """Create the ledger and the parking table in the consumer's database (idempotent)."""
    require_idle(conn)
    ddl = sql.SQL(_LEDGER_DDL).format(
        ledger=table_identifier(ledger_table),
        ledger_idx=sql.Identifier(f"{ledger_table.rsplit('.', 1)[-1]}_processed_at_idx"),
        parking=table_identifier(parking_table),
    )
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK_KEY,))
        for statement in ddl.as_string(conn).split(";"):
            if statement.strip():
                conn.execute(statement.encode())


def prune_ledger(
    conn: Conn,
    *,
    older_than_s: float,
    consumer_name: str | None = None,
    ledger_table: str = DEFAULT_LEDGER_TABLE,
    batch_size: int = PRUNE_BATCH,
) -> int:
    """Delete ledger rows older than ``older_than_s`` (of one consumer, or all); return
    how many. Each batch is its own transaction."""
    require_idle(conn)
    if older_than_s < 0 or batch_size < 1:
        raise ConsumerUsageError("older_than_s must be >= 0 and batch_size >= 1")
    mine = sql.SQL("AND consumer_name = %(name)s") if consumer_name else sql.SQL("")
    stmt = sql.SQL(
        "DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM {t}"
        " WHERE processed_at < now() - make_interval(secs => %(age)s) {mine} LIMIT %(n)s)"
    ).format(t=table_identifier(ledger_table), mine=mine)
    params = {"age": older_than_s, "name": consumer_name, "n": batch_size}
    total = 0
    while True:
        with conn.transaction():
            deleted = max(conn.execute(stmt, params).rowcount, 0)
        total += deleted
        if deleted < batch_size:
            return total


def require_idle(conn: Conn) -> None:
    """The helper's transactions must be real ones, not savepoints in the caller's."""
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise ConsumerUsageError(
            f"the consumer's connection must be idle between records, not {status.name}: "
            "a transaction left open would turn the helper's commits into savepoints"
        )


def safe_text(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` fit for a text column (no NUL) and at most ``limit`` characters."""
    return text.replace("\x00", "\ufffd")[:limit]


class Ledger:
    """The SQL of one consumer's two tables, on its connection (inside its transactions)."""

    def __init__(self, conn: Conn, *, name: str, ledger_table: str, parking_table: str) -> None:
        self._conn = conn
        self._name = name
        self._ledger = table_identifier(ledger_table)
        self._parking = table_identifier(parking_table)

    def insert(self, event_id: str, record: Envelope, outcome: str) -> bool:
        """The ledger row; False when the event id is already there (a duplicate)."""
        cur = self._conn.execute(
            sql.SQL(
                'INSERT INTO {} (consumer_name, event_id, outcome, topic, "partition", "offset")'
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
            ).format(self._ledger),
            (self._name, event_id, outcome, record.topic, record.partition, record.offset),
        )
        return cur.rowcount == 1

    def park(self, record: Envelope, event_id: str | None, reason: str, attempts: int) -> None:
        """The record's row in the parking table, byte for byte (once per position)."""
        self._conn.execute(
            sql.SQL(
                'INSERT INTO {} (consumer_name, event_id, topic, "partition", "offset",'
                " record_key, record_value, header_names, header_values, timestamp_ms,"
                " reason, attempts) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                ' ON CONFLICT (consumer_name, topic, "partition", "offset") DO NOTHING'
            ).format(self._parking),
            (
                self._name,
                event_id,
                record.topic,
                record.partition,
                record.offset,
                record.key,
                record.value,
                [safe_text(name) for name, _ in record.header_list],
                [value for _, value in record.header_list],
                record.timestamp_ms,
                safe_text(reason),
                attempts,
            ),
        )
