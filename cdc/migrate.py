"""Schema migrations: numbered plain-SQL files under ``sql/``, applied once each.

Guarantees:

* files ``NNN_name.sql`` are applied in numeric order, each in its own
  transaction together with its row in ``outbox_cdc_schema_migrations``, so a
  failing file leaves nothing of itself behind;
* the product schema (``sql/NNN_*.sql``: the outbox, its publication, the
  parking lot, its leases and functions) is all ``migrate`` creates; the demo's
  tables (``sql/demo/NNN_*.sql``: ``users``, ``quiz_attempts``) only with
  ``demo=True``. Both share one numbering and one ledger, so a database
  migrated before the split (its ``002`` recorded) stays valid as it is;
* a second run applies nothing (the recorded versions are skipped);
* an applied file whose text changed since is refused, not silently re-run;
* two concurrent runs serialise on an advisory lock;
* :func:`status` reads the ledger and changes nothing (no table is created);
* a server whose ``wal_level`` is not ``logical`` is refused up front with the fix;
* the files are found without a checkout: an installed wheel carries them as
  package data (``cdc/sql``), a checkout has them in ``sql/``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import psycopg

from cdc.constants import MIGRATION_LOCK_KEY
from cdc.errors import DatabaseSetupError, MigrationError
from cdc.pgconn import Use, connect

log = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^(\d{3,})_[\w-]+\.sql$")
HISTORY_TABLE = "outbox_cdc_schema_migrations"
_CREATE_HISTORY = (
    "CREATE TABLE IF NOT EXISTS outbox_cdc_schema_migrations ("
    " version text PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
    " applied_at timestamptz NOT NULL DEFAULT now())"
)


#: Sub-directory of the SQL directory holding the demo domain's migrations.
DEMO_SUBDIR = "demo"


class Part(StrEnum):
    """Whose schema a migration file belongs to."""

    PRODUCT = "product"
    DEMO = "demo"


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: str
    path: Path
    part: Part = Part.PRODUCT

    @property
    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


#: The migrations inside an installed wheel (``sql/`` shipped as package data).
PACKAGED_SQL_DIR = Path(__file__).resolve().parent / "sql"
#: The migrations of a checkout (the source of the packaged copy).
CHECKOUT_SQL_DIR = Path(__file__).resolve().parent.parent / "sql"


def sql_dir() -> Path:
    """Where the migration files are: ``CDC_SQL_DIR``, the wheel's copy, or the checkout's."""
    override = os.environ.get("CDC_SQL_DIR")
    if override:
        return Path(override)
    return PACKAGED_SQL_DIR if PACKAGED_SQL_DIR.is_dir() else CHECKOUT_SQL_DIR


def discover(directory: Path | None = None, *, demo: bool = False) -> list[Migration]:
    """The migration files of ``directory`` (and its ``demo/`` with ``demo``) in order.

    The numbers are unique over both parts, whichever is asked for.
    """
    directory = directory or sql_dir()
    if not directory.is_dir():
        raise MigrationError(f"migration directory {directory} not found (set CDC_SQL_DIR)")
    found = _files(directory, Part.PRODUCT) + _files(directory / DEMO_SUBDIR, Part.DEMO)
    found.sort(key=lambda m: int(m.version))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration numbers in {directory}: {versions}")
    return [m for m in found if demo or m.part is Part.PRODUCT]


def _files(directory: Path, part: Part) -> list[Migration]:
    if not directory.is_dir():
        return []
    return [
        Migration(version=match.group(1), path=path, part=part)
        for path in directory.iterdir()
        if (match := _FILE_RE.match(path.name))
    ]


def check_wal_level(conn: psycopg.Connection[Any]) -> None:
    """Raise :class:`DatabaseSetupError` unless the server runs ``wal_level=logical``."""
    row = conn.execute("SHOW wal_level").fetchone()
    level = str(row[0]) if row else "unknown"
    if level != "logical":
        raise DatabaseSetupError(
            f"wal_level is {level!r} but logical replication needs 'logical': "
            "set wal_level = logical in postgresql.conf (or -c wal_level=logical) "
            "and restart PostgreSQL"
        )


def migrate(dsn: str, *, directory: Path | None = None, demo: bool = False) -> list[str]:
    """Apply every pending migration; return the versions applied by this run.

    The product schema only, unless ``demo`` (then the demo's tables too).
    """
    migrations = discover(directory, demo=demo)
    applied_now: list[str] = []
    with connect(dsn, Use.CLI) as conn:
        check_wal_level(conn)
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        try:
            conn.execute(_CREATE_HISTORY)
            done: dict[str, str] = {
                str(v): str(c)
                for v, c in conn.execute(
                    "SELECT version, checksum FROM outbox_cdc_schema_migrations"
                ).fetchall()
            }
            for migration in migrations:
                if migration.version in done:
                    if done[migration.version] != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.path.name} was applied but has changed "
                            "since; add a new numbered file instead of editing it"
                        )
                    continue
                _apply(conn, migration)
                applied_now.append(migration.version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied_now


def _apply(conn: psycopg.Connection[Any], migration: Migration) -> None:
    log.info("migration %s applying", migration.path.name, extra={"migration": migration.version})
    try:
        with conn.transaction():
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO outbox_cdc_schema_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                (migration.version, migration.path.name, migration.checksum),
            )
    except psycopg.Error as exc:
        raise MigrationError(f"migration {migration.path.name} failed: {exc}") from exc


@dataclass(frozen=True)
class MigrationState:
    """One migration as ``migrate --status`` shows it."""

    version: str
    name: str
    part: Part | None  # None: recorded in the ledger, no such file here
    applied_at: str | None  # ISO-8601; None: pending

    def as_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "name": self.name,
            "part": self.part.value if self.part else None,
            "applied": self.applied_at is not None,
            "applied_at": self.applied_at,
        }


def status(dsn: str, *, directory: Path | None = None, demo: bool = False) -> list[MigrationState]:
    """Every known migration, applied or pending, in order; reads only.

    Demo files are listed when applied, or with ``demo`` when pending.
    """
    files = {m.version: m for m in discover(directory, demo=True)}
    with connect(dsn, Use.CLI) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (HISTORY_TABLE,)).fetchone()
        ledger = (
            conn.execute(
                "SELECT version, name, applied_at FROM outbox_cdc_schema_migrations"
            ).fetchall()
            if row and row[0]
            else []
        )
    applied = {str(v): (str(n), at.isoformat()) for v, n, at in ledger}
    states = []
    for version in sorted(files.keys() | applied.keys(), key=int):
        migration = files.get(version)
        name, at = applied.get(version, (migration.path.name if migration else version, None))
        if at is None and migration is not None and migration.part is Part.DEMO and not demo:
            continue
        states.append(MigrationState(version, name, migration.part if migration else None, at))
    return states
