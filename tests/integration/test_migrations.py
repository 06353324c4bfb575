"""Migrations against a real PostgreSQL: order, idempotence, refusal of edits."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.errors import DatabaseSetupError, MigrationError
from cdc.migrate import Part, check_wal_level, discover, migrate, status


def _tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {r[0] for r in rows}


def test_migrations_apply_in_order_on_an_empty_database(empty_db_dsn: str) -> None:
    applied = migrate(empty_db_dsn)
    assert applied == [m.version for m in discover()]
    assert {"outbox", "failed_sync_events"} <= _tables(empty_db_dsn)
    with psycopg.connect(empty_db_dsn) as conn:
        pub = conn.execute(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication"
            " WHERE pubname = 'outbox_pub'"
        ).fetchone()
        tables = conn.execute(
            "SELECT tablename FROM pg_publication_tables WHERE pubname = 'outbox_pub'"
        ).fetchall()
    assert pub == (True, False, False, False)
    assert tables == [("outbox",)]


def test_second_run_applies_nothing_and_changes_nothing(empty_db_dsn: str) -> None:
    migrate(empty_db_dsn)
    with psycopg.connect(empty_db_dsn) as conn:
        before = conn.execute(
            "SELECT version, checksum, applied_at FROM outbox_cdc_schema_migrations ORDER BY 1"
        ).fetchall()
    assert migrate(empty_db_dsn) == []
    with psycopg.connect(empty_db_dsn) as conn:
        after = conn.execute(
            "SELECT version, checksum, applied_at FROM outbox_cdc_schema_migrations ORDER BY 1"
        ).fetchall()
    assert before == after


def test_an_edited_applied_migration_is_refused(empty_db_dsn: str, tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[2] / "sql"
    for f in src.glob("*.sql"):
        shutil.copy(f, tmp_path / f.name)
    migrate(empty_db_dsn, directory=tmp_path)
    target = tmp_path / "003_failed_sync_events.sql"
    target.write_text(target.read_text() + "\n-- edited\n")
    with pytest.raises(MigrationError, match=r"003_failed_sync_events\.sql"):
        migrate(empty_db_dsn, directory=tmp_path)


def test_a_failing_migration_leaves_nothing_of_itself(empty_db_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "001_ok.sql").write_text("CREATE TABLE t_ok (id int);")
    (tmp_path / "002_bad.sql").write_text("CREATE TABLE t_bad (id int); SELECT no_such_fn();")
    with pytest.raises(MigrationError, match=r"002_bad\.sql"):
        migrate(empty_db_dsn, directory=tmp_path)
    assert "t_ok" in _tables(empty_db_dsn)
    assert "t_bad" not in _tables(empty_db_dsn)


DEMO_TABLES = {"users", "quiz_attempts"}


def test_migrate_creates_only_outbox_cdc_objects_and_demo_adds_the_demo_tables(
    empty_db_dsn: str,
) -> None:
    """An application database gets the outbox and the parking lot, nothing of the demo."""
    applied = migrate(empty_db_dsn)
    assert "002" not in applied
    assert not DEMO_TABLES & _tables(empty_db_dsn)
    pending = [s for s in status(empty_db_dsn, demo=True) if s.applied_at is None]
    assert [(s.version, s.part) for s in pending] == [("002", Part.DEMO)]
    assert migrate(empty_db_dsn, demo=True) == ["002"]
    assert _tables(empty_db_dsn) >= DEMO_TABLES
    assert all(s.applied_at for s in status(empty_db_dsn, demo=True))


def test_an_application_users_table_of_its_own_is_left_alone(empty_db_dsn: str) -> None:
    """The issue's case: a users table whose id is not a uuid; migrate must not touch it."""
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE users (id bigint PRIMARY KEY, login text)")
    migrate(empty_db_dsn)
    with psycopg.connect(empty_db_dsn) as conn:
        columns = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'users'"
            " ORDER BY ordinal_position"
        ).fetchall()
    assert columns == [("id",), ("login",)]
    assert "quiz_attempts" not in _tables(empty_db_dsn)


def test_a_database_migrated_before_the_split_keeps_working(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    """Before the split every file sat in sql/: 002_domain.sql was applied like the others."""
    src = Path(__file__).resolve().parents[2] / "sql"
    for f in [*src.glob("*.sql"), *src.glob("demo/*.sql")]:
        shutil.copy(f, tmp_path / f.name)  # the old layout: one flat directory
    migrate(empty_db_dsn, directory=tmp_path)
    assert _tables(empty_db_dsn) >= DEMO_TABLES
    assert migrate(empty_db_dsn) == []  # the new layout: nothing to do, nothing refused
    assert migrate(empty_db_dsn, demo=True) == []  # 002 recorded with the same checksum
    states = {s.version: s for s in status(empty_db_dsn)}
    assert states["002"].applied_at is not None
    assert states["002"].part is Part.DEMO
    assert _tables(empty_db_dsn) >= DEMO_TABLES  # nothing dropped


def test_status_reads_only(empty_db_dsn: str) -> None:
    states = status(empty_db_dsn)
    assert states
    assert all(s.applied_at is None for s in states)
    assert all(s.part is Part.PRODUCT for s in states)  # demo files only with demo=True
    assert "outbox_cdc_schema_migrations" not in _tables(empty_db_dsn)


class _FakeConn:
    """Answers SHOW wal_level like a server configured with ``level``."""

    def __init__(self, level: str) -> None:
        self.level = level

    def execute(self, query: str) -> Any:
        assert query == "SHOW wal_level"
        return self

    def fetchone(self) -> tuple[str]:
        return (self.level,)


def test_wal_level_other_than_logical_names_setting_and_fix() -> None:
    with pytest.raises(DatabaseSetupError) as info:
        check_wal_level(_FakeConn("replica"))  # type: ignore[arg-type]
    assert "wal_level" in str(info.value)
    assert "wal_level = logical" in str(info.value)
    assert "restart" in str(info.value)


def test_real_server_runs_logical_wal(pg_server: str) -> None:
    with psycopg.connect(pg_server) as conn:
        check_wal_level(conn)


def _cli(dsn: str, *args: str) -> Any:
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cdc.cli", "migrate", *args],
        env={**os.environ, "CDC_PG_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_migrate_status_and_json_from_the_command_line(empty_db_dsn: str) -> None:
    before = _cli(empty_db_dsn, "--status", "--json")
    applied = _cli(empty_db_dsn, "--json")
    after = _cli(empty_db_dsn, "--status", "--demo", "--json")

    assert before["applied"] == []
    assert [m["version"] for m in before["pending"]] == applied["applied"]
    assert applied["demo"] is False
    assert [m["version"] for m in after["pending"]] == ["002"]
    assert after["pending"][0]["part"] == "demo"
    assert all(m["applied_at"] for m in after["applied"])
