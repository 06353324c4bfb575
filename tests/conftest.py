"""Fixtures that reach the real services.

Endpoints, in order of preference:

1. ``OUTBOX_TEST_SERVICES=testcontainers``: PostgreSQL and Kafka of the session's own,
   started with testcontainers (:mod:`tests.containers`; removed at the end, by label);
2. ``CDC_PG_DSN`` / ``KAFKA_BOOTSTRAP_SERVERS`` from the environment;
3. the local stack (``compose/stack.sh up``, which also writes ``.dev/env``);
4. testcontainers, when the local stack failed and a Docker engine answers.

When none works the test fails in CI (``CI=true``) and is skipped, with the
reason, elsewhere. Each session works in its own freshly migrated database and
every test gets unique slot/publication/topic names, so tests never see each
other's events. Slot-loss tests also get a primary with a streaming standby of
their own (``cluster_pair``, see :mod:`tests.clusters`).
"""

from __future__ import annotations

import os
import subprocess
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings
from psycopg import sql

from cdc.migrate import migrate
from tests.clusters import ClusterPair, clusters_root

ROOT = Path(__file__).resolve().parent.parent

# No example may fail for being slow: ``make test`` runs the unit tests at nice 19
# beside the integration tests, so an example can wait for a core. Speed is measured
# by the benchmarks, never asserted in a test. Each test's own settings still apply.
settings.register_profile("outbox-cdc", deadline=None)
settings.load_profile("outbox-cdc")

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
#: The local stack's directory: ``.dev``, or another stack's (``OUTBOX_DEV_DIR``, the
#: second lane of ``make test``), whose ``env`` names its services.
DEV_DIR = Path(os.environ.get("OUTBOX_DEV_DIR") or ROOT / ".dev")


@dataclass(frozen=True)
class Services:
    """Where the real services are."""

    pg_dsn: str  # superuser DSN of the server's maintenance database
    kafka_bootstrap: str
    origin: str  # env | local-stack | testcontainers


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"required service unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"service unavailable: {reason}")


def _read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            out[key] = value.strip().strip("'\"")
    return out


def _local_stack() -> Services | None:
    script = ROOT / "compose" / "stack.sh"
    proc = subprocess.run(
        ["bash", str(script), "up"], capture_output=True, text=True, timeout=900, check=False
    )
    env_file = DEV_DIR / "env"
    if proc.returncode != 0 or not env_file.exists():
        print(proc.stderr[-4000:])
        return None
    env = _read_env_file(env_file)
    return Services(env["CDC_PG_DSN"], env["KAFKA_BOOTSTRAP_SERVERS"], "local-stack")


#: Where the integration tests find PostgreSQL and Kafka (OUTBOX_TEST_SERVICES): ``local``
#: (the default: the environment's, else the local stack's) or ``testcontainers``.
SERVICES_MODES = ("local", "testcontainers")
SERVICES_MODE = os.environ.get("OUTBOX_TEST_SERVICES") or "local"


def _testcontainers() -> Iterator[Services]:  # pragma: no cover - needs a Docker engine
    from tests.containers import docker_answers, start_session_services

    if not docker_answers():
        _unavailable("OUTBOX_TEST_SERVICES=testcontainers, but no Docker engine answers")
    started = start_session_services()
    try:
        yield Services(started.pg_dsn, started.kafka_bootstrap, "testcontainers")
    finally:
        started.close()


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    if SERVICES_MODE not in SERVICES_MODES:
        pytest.exit(
            f"OUTBOX_TEST_SERVICES={SERVICES_MODE!r}: choose one of {', '.join(SERVICES_MODES)}",
            returncode=2,
        )
    if SERVICES_MODE == "testcontainers":
        yield from _testcontainers()
        return
    dsn = os.environ.get("CDC_PG_DSN")
    kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if dsn and kafka:
        local = DEV_DIR / "env"
        if local.exists():
            env = _read_env_file(local)
            if (env.get("CDC_PG_DSN"), env.get("KAFKA_BOOTSTRAP_SERVERS")) == (dsn, kafka):
                yield Services(dsn, kafka, "local-stack")
                return
        yield Services(dsn, kafka, "env")
        return
    found = _local_stack()
    if found is not None:
        yield found
        return
    from tests.containers import docker_answers

    if not docker_answers():
        _unavailable("no CDC_PG_DSN/KAFKA_BOOTSTRAP_SERVERS, local stack failed, no Docker engine")
    yield from _testcontainers()


def dsn_for_db(dsn: str, dbname: str) -> str:
    """The same server and credentials, another database."""
    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


@pytest.fixture(scope="session")
def pg_server(services: Services) -> str:
    """Superuser DSN; fails loudly when the server does not answer."""
    try:
        with psycopg.connect(services.pg_dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL at {services.origin}: {exc}")
    return services.pg_dsn


def create_database(server_dsn: str, prefix: str) -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return dsn_for_db(server_dsn, name)


def drop_database(server_dsn: str, db_dsn: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"]
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        for (slot,) in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = %s AND NOT active",
            (name,),
        ).fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name)))
        )


@pytest.fixture(scope="session")
def db_dsn(pg_server: str) -> Iterator[str]:
    """A database private to this test session, migrated with the demo's tables.

    Most tests write events through the demo's domain (``register_user``), so
    this database has ``users`` and ``quiz_attempts`` too (``migrate --demo``).
    """
    dsn = create_database(pg_server, "cdc_test")
    migrate(dsn, demo=True)
    yield dsn
    drop_database(pg_server, dsn)


@pytest.fixture
def empty_db_dsn(pg_server: str) -> Iterator[str]:
    """An empty database private to one test."""
    dsn = create_database(pg_server, "cdc_empty")
    yield dsn
    drop_database(pg_server, dsn)


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Services) -> str:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    try:
        admin.list_topics(timeout=15)
    except Exception as exc:
        _unavailable(f"Kafka at {services.kafka_bootstrap}: {exc}")
    return services.kafka_bootstrap


@pytest.fixture
def unique() -> str:
    """A short unique suffix for slot, publication, topic and group names."""
    return uuid.uuid4().hex[:10]


#: A password naive redaction gets wrong: spaces, a quote, a backslash.
DB_PASSWORD = "s3cr3t pass' wheel\\x"


@dataclass(frozen=True)
class PasswordDb:
    """An empty database of a role whose password needs quoting, as DSNs of several forms."""

    keyvalue_dsn: str  # password = '...' with spaces around "=" and quotes
    query_dsn: str  # postgresql://role@host:port/db?password=...
    role: str
    password: str


@pytest.fixture
def password_db(pg_server: str) -> Iterator[PasswordDb]:
    """A fresh role (LOGIN REPLICATION SUPERUSER) with :data:`DB_PASSWORD` and its database."""
    role = f"pw_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN REPLICATION SUPERUSER PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(DB_PASSWORD)
            )
        )
    dsn = create_database(pg_server, "cdc_pw")
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    quoted = DB_PASSWORD.replace("\\", "\\\\").replace("'", "\\'")
    keyvalue = (
        f"host={params['host']} port={params['port']} dbname={params['dbname']} "
        f"user={role} password = '{quoted}'"
    )
    query = (
        f"postgresql://{role}@{params['host']}:{params['port']}/{params['dbname']}"
        f"?password={urllib.parse.quote(DB_PASSWORD, safe='')}"
    )
    for form in (keyvalue, query):
        with psycopg.connect(form) as conn:  # each form works as written
            conn.execute("SELECT 1")
    yield PasswordDb(keyvalue, query, role, DB_PASSWORD)
    drop_database(pg_server, dsn)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


# -- a primary with a streaming standby of the tests' own (slot-loss tests) ---------------


@pytest.fixture(scope="session")
def cluster_pair() -> Iterator[ClusterPair]:
    """Built once per session (initdb + pg_basebackup): see :mod:`tests.clusters`."""
    pair = ClusterPair.create(clusters_root())
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def pair(cluster_pair: ClusterPair) -> ClusterPair:
    """The pair, whole: a primary and a standby streaming from it (re-cloned only when a
    test promoted the standby or broke the link)."""
    cluster_pair.heal()
    return cluster_pair


@pytest.fixture
def pair_db(pair: ClusterPair) -> Iterator[str]:
    """A migrated database on the pair, as its multi-host DSN (follows a failover)."""
    name = f"cdc_pair_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(pair.primary.dsn(name))
    yield pair.dsn(name)
    pair.heal()
    drop_database(pair.primary.dsn(), pair.primary.dsn(name))
