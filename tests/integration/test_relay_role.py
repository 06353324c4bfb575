"""The least-privilege role script: the relay streams as `outbox_relay`."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest

from cdc.outbox import register_user
from tests.harness import ROOT, RelayConfig, headers_of, read_topics, start_relay

pytestmark = pytest.mark.integration


def _psql() -> str:
    found = shutil.which("psql")
    assert found, "psql (postgresql-client) is needed to run sql/roles/relay_role.sql"
    return found


def test_relay_streams_as_the_least_privileged_role(
    db_dsn: str, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    password = secrets.token_hex(12)
    subprocess.run(
        [
            _psql(),
            db_dsn,
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            f"relay_password='{password}'",
            "-q",
            "-f",
            str(ROOT / "sql" / "roles" / "relay_role.sql"),
        ],
        check=True,
        capture_output=True,
        env=os.environ.copy(),
        timeout=60,
    )
    role_dsn = psycopg.conninfo.make_conninfo(db_dsn, user="outbox_relay", password=password)
    with psycopg.connect(role_dsn) as conn:
        attrs = conn.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication FROM pg_roles"
            " WHERE rolname = current_user"
        ).fetchone()
        assert attrs == (False, False, False, True)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO users (email, display_name) VALUES ('x@y', 'x')")
    cfg = RelayConfig(db_dsn=role_dsn, kafka=kafka_bootstrap, unique=unique)
    relay, _ = start_relay(cfg, tmp_path)
    try:
        with psycopg.connect(db_dsn) as conn:
            written = register_user(conn, email=f"{uuid.uuid4()}@ex.org", display_name="R")
        msgs = read_topics(kafka_bootstrap, [cfg.topic_prefix + "user"], expect=1)
        assert [headers_of(m)["id"].decode() for m in msgs] == [str(written.event_id)]
        assert "password" not in relay.log_path.read_text().lower().replace("password=***", "")
        assert password not in relay.log_path.read_text()
    finally:
        relay.close()
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (cfg.slot,))
