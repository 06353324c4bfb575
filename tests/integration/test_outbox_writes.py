"""The application side against a real PostgreSQL: what reaches the slot.

A committed demo operation puts exactly one outbox insert into the WAL that
the publication exposes; a rolled-back one puts none.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from cdc.outbox import (
    OutboxEvent,
    OutboxUsageError,
    emit_event,
    register_user,
    submit_quiz_attempt,
    write_event,
)

PEEK = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL,"
    " 'proto_version', '1', 'publication_names', 'outbox_pub', 'messages', 'true')"
)


@pytest.fixture
def slot(db_dsn: str, unique: str) -> Iterator[str]:
    name = f"t_slot_{unique}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    yield name
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def _messages(dsn: str, slot: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        return [bytes(r[0]) for r in conn.execute(PEEK, (slot,)).fetchall()]


def _inserts(dsn: str, slot: str) -> list[bytes]:
    return [m for m in _messages(dsn, slot) if m[:1] == b"I"]


def test_committed_registration_yields_exactly_one_outbox_event(db_dsn: str, slot: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        written = register_user(conn, email=f"{uuid.uuid4()}@example.org", display_name="Ana")
    inserts = _inserts(db_dsn, slot)
    assert len(inserts) == 1
    assert str(written.event_id).encode() in inserts[0]
    assert b"UserRegistered" in inserts[0]
    assert str(written.entity_id).encode() in inserts[0]


def test_rolled_back_registration_yields_no_event(db_dsn: str, slot: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            register_user(conn, email=f"{uuid.uuid4()}@example.org", display_name="Bo")
            raise RuntimeError("business failure after the event was written")
        with psycopg.connect(db_dsn) as check:
            users = check.execute("SELECT count(*) FROM users WHERE display_name = 'Bo'")
            assert users.fetchone() == (0,)
    assert _inserts(db_dsn, slot) == []


def test_quiz_attempt_event_is_keyed_by_user_and_commits_with_the_row(
    db_dsn: str, slot: str
) -> None:
    with psycopg.connect(db_dsn) as conn:
        user = register_user(conn, email=f"{uuid.uuid4()}@example.org", display_name="Cy")
        attempt = submit_quiz_attempt(conn, user_id=user.entity_id, quiz_id="q1", score=7)
    inserts = _inserts(db_dsn, slot)
    assert len(inserts) == 2
    assert str(attempt.event_id).encode() in inserts[1]
    assert b"QuizAttemptSubmitted" in inserts[1]


def test_delete_after_mode_keeps_the_table_empty_but_the_wal_has_the_insert(
    db_dsn: str, slot: str
) -> None:
    with psycopg.connect(db_dsn) as conn:
        written = register_user(
            conn, email=f"{uuid.uuid4()}@example.org", display_name="Di", delete_after=True
        )
        row = conn.execute("SELECT count(*) FROM outbox WHERE id = %s", (written.event_id,))
        assert row.fetchone() == (0,)
    inserts = _inserts(db_dsn, slot)
    assert len(inserts) == 1
    assert str(written.event_id).encode() in inserts[0]


def test_logical_message_variant_reaches_the_slot_transactionally(db_dsn: str, slot: str) -> None:
    event = OutboxEvent(
        aggregate_type="user",
        aggregate_id="u-1",
        event_type="UserRegistered",
        payload={"user_id": "u-1"},
    )
    with psycopg.connect(db_dsn) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            emit_event(
                conn,
                OutboxEvent(
                    aggregate_type="user",
                    aggregate_id="u-0",
                    event_type="UserRegistered",
                    payload={},
                ),
            )
            raise RuntimeError("rolled back")
        with conn.transaction():
            emit_event(conn, event)
    messages = [m for m in _messages(db_dsn, slot) if m[:1] == b"M"]
    assert len(messages) == 1
    assert b"outbox\x00" in messages[0]
    assert str(event.event_id).encode() in messages[0]


def test_autocommit_connection_outside_a_transaction_is_refused(db_dsn: str) -> None:
    event = OutboxEvent(aggregate_type="user", aggregate_id="x", event_type="T", payload={})
    with psycopg.connect(db_dsn, autocommit=True) as conn, pytest.raises(OutboxUsageError):
        write_event(conn, event)
