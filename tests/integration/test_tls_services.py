"""PostgreSQL over TLS and Kafka over SSL and SASL_SSL, end to end, with the tests' own CA.

The module starts, once, servers that accept nothing but TLS:

* a PostgreSQL cluster (:class:`tests.clusters.PgNode`, ``ssl = on``) whose
  ``pg_hba.conf`` has ``hostssl`` lines only: the relay's least-privileged role
  (``sql/roles/relay_role.sql``) needs its password *and* a client certificate naming it
  (``clientcert=verify-full``), every other role its password over TLS; there is no
  ``replication`` line (the relay's logical replication connection is matched by its
  database, as docs/configuration/tls.md says);
* a Kafka broker (:class:`tests.brokers.TlsBroker`) with an ``SSL`` listener requiring
  client certificates and a ``SASL_SSL`` listener with SCRAM-SHA-512.

Server and client certificates come from a private CA made here (:mod:`tests.pki`); the
client key is encrypted. The pipeline runs over them exactly as docs/configuration/tls.md
shows: the relay with ``sslmode=verify-full`` and a client certificate to PostgreSQL and
``KAFKA_CONFIG_SECURITY_PROTOCOL=SSL`` with a client certificate to Kafka; the sink with
``verify-full`` (no client certificate) and ``SASL_SSL``; the ops commands with each.
Events written to the outbox must reach the engine stub. Each wrong setting (a CA that did
not sign the server's certificate, a host name it does not name, no client certificate
where one is required, a plaintext client) must come back as one clear line - and no
password or key passphrase may appear in any output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from cdc.migrate import migrate
from cdc.outbox import register_user
from sinks.stub.server import StubServer
from tests.brokers import SASL_MECHANISM, TlsBroker
from tests.clusters import PgNode, bindir, clusters_root
from tests.harness import (
    ROOT,
    Proc,
    RelayConfig,
    SinkConfig,
    free_port,
    start_relay,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY
from tests.pki import Pki, make_pki

pytestmark = pytest.mark.integration

DB = "outbox"
#: Secrets of the module, each distinctive enough that finding it in an output is no accident.
SUPERUSER_PASSWORD = "pg-super pass 7Hq2"
RELAY_PASSWORD = "relay-role pass 9Xk4"
KEY_PASSPHRASE = "client-key phrase 3Vb8'q"
SASL_USER = "outbox-cdc"
SASL_PASSWORD = "scram-pass 5Nd1"
SECRETS = (SUPERUSER_PASSWORD, RELAY_PASSWORD, KEY_PASSPHRASE, SASL_PASSWORD)
#: The relay's role is the client certificate's common name (``clientcert=verify-full``).
RELAY_ROLE = "outbox_relay"
HBA = f"""\
# The tests' own administration, over the Unix socket.
local   all  postgres                      trust
# TCP: TLS only. The relay's role needs its password and a client certificate naming it.
hostssl all  {RELAY_ROLE}  127.0.0.1/32  scram-sha-256  clientcert=verify-full
hostssl all  all           127.0.0.1/32  scram-sha-256
"""
USERS = 20
#: Bound of the events' way from the outbox to the engine on a loaded machine.
DELIVERY_TIMEOUT_S = 120
CLI_TIMEOUT_S = 120


@dataclass
class TlsServices:
    """The module's TLS-only servers and the files a client needs."""

    pki: Pki
    other: Pki  # another CA: signed nothing the servers present
    node: PgNode
    broker: TlsBroker

    def relay_dsn(self, **overrides: str) -> str:
        """The relay's DSN: verify-full, its password and client certificate."""
        params = {
            "host": "127.0.0.1",
            "port": str(self.node.port),
            "dbname": DB,
            "user": RELAY_ROLE,
            "password": RELAY_PASSWORD,
            "sslmode": "verify-full",
            "sslrootcert": str(self.pki.ca_cert),
            "sslcert": str(self.pki.client_cert),
            "sslkey": str(self.pki.client_key),
            "sslpassword": KEY_PASSPHRASE,
            "connect_timeout": "10",
        }
        params.update(overrides)
        return make_conninfo("", **{k: v for k, v in params.items() if v})

    def sink_dsn(self, **overrides: str) -> str:
        """The sink's and the ops commands' DSN: verify-full and a password, no client cert."""
        params = {
            "host": "127.0.0.1",
            "port": str(self.node.port),
            "dbname": DB,
            "user": "postgres",
            "password": SUPERUSER_PASSWORD,
            "sslmode": "verify-full",
            "sslrootcert": str(self.pki.ca_cert),
            "connect_timeout": "10",
        }
        params.update(overrides)
        return make_conninfo("", **{k: v for k, v in params.items() if v})

    def kafka_ssl(self, **overrides: str) -> dict[str, str]:
        """TLS with a client certificate (the SSL listener), as ``KAFKA_CONFIG_*``."""
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.broker.ssl_bootstrap,
            "KAFKA_CONFIG_SECURITY_PROTOCOL": "SSL",
            "KAFKA_CONFIG_SSL_CA_LOCATION": str(self.pki.ca_cert),
            "KAFKA_CONFIG_SSL_CERTIFICATE_LOCATION": str(self.pki.client_cert),
            "KAFKA_CONFIG_SSL_KEY_LOCATION": str(self.pki.client_key),
            "KAFKA_CONFIG_SSL_KEY_PASSWORD": KEY_PASSPHRASE,
        }
        env.update(overrides)
        return {k: v for k, v in env.items() if v}

    def kafka_sasl(self, **overrides: str) -> dict[str, str]:
        """SCRAM over TLS (the SASL_SSL listener), as ``KAFKA_CONFIG_*``."""
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.broker.sasl_ssl_bootstrap,
            "KAFKA_CONFIG_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_CONFIG_SASL_MECHANISM": SASL_MECHANISM,
            "KAFKA_CONFIG_SASL_USERNAME": SASL_USER,
            "KAFKA_CONFIG_SASL_PASSWORD": SASL_PASSWORD,
            "KAFKA_CONFIG_SSL_CA_LOCATION": str(self.pki.ca_cert),
        }
        env.update(overrides)
        return {k: v for k, v in env.items() if v}


def _psql(dsn: str, *args: str) -> None:
    subprocess.run(
        [str(bindir() / "psql"), dsn, "-v", "ON_ERROR_STOP=1", "-q", *args],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _set_up_database(node: PgNode) -> None:
    """The outbox database (migrated as the superuser), the relay's role, the passwords."""
    with psycopg.connect(node.socket_dsn(), autocommit=True) as conn:
        conn.execute(f"ALTER ROLE postgres PASSWORD '{SUPERUSER_PASSWORD}'")
        conn.execute(f"CREATE DATABASE {DB}")
    migrate(node.socket_dsn(DB), demo=True)
    _psql(
        node.socket_dsn(DB),
        "-v",
        f"relay_password='{RELAY_PASSWORD}'",
        "-f",
        str(ROOT / "sql" / "roles" / "relay_role.sql"),
    )


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServices]:
    pki_dir = tmp_path_factory.mktemp("tls-pki")
    pki = make_pki(pki_dir, client_name=RELAY_ROLE, client_key_passphrase=KEY_PASSPHRASE)
    other = make_pki(pki_dir, name="other")
    root = clusters_root()
    broker = TlsBroker(root / "kafka", pki, SASL_USER, SASL_PASSWORD)
    node = PgNode("tls", root)
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(broker.start)  # a JVM's start, beside initdb and migrate
            node.initdb()
            node.enable_tls(pki, HBA)
            node.start()
            _set_up_database(node)
            started.result()
        yield TlsServices(pki=pki, other=other, node=node, broker=broker)
    finally:
        node.stop("immediate")
        broker.close()
        shutil.rmtree(root, ignore_errors=True)


def _env(dsn: str, kafka: dict[str, str], **extra: str) -> dict[str, str]:
    """A clean environment (nothing of the stack's) with this DSN and Kafka client."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CDC_", "KAFKA_", "SINK_", "ENGINE_", "OUTBOX_"))
    }
    env.update({"CDC_PG_DSN": dsn, **kafka, **extra})
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def cli_all(
    *runs: tuple[dict[str, str], tuple[str, ...]],
) -> list[subprocess.CompletedProcess[str]]:
    """Commands (environment, arguments) at once: a failing one waits out its connect timeout."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(cli, env, *args) for env, args in runs]
        return [future.result() for future in futures]


def findings(done: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """``check --json``'s findings: item -> (status, detail)."""
    report = json.loads(done.stdout)
    return {f["item"]: (f["status"], f["detail"]) for f in report["findings"]}


def assert_no_secret(*outputs: str) -> None:
    for output in outputs:
        for secret in SECRETS:
            assert secret not in output, f"a secret is shown:\n{output}"


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


@dataclass
class Pipeline:
    relay_cfg: RelayConfig
    sink_cfg: SinkConfig
    relay: Proc
    relay_port: int
    sink: Proc
    stub: StubServer

    def relay_env(self) -> dict[str, str]:
        return self.relay_cfg.env(free_port())

    def sink_env(self) -> dict[str, str]:
        return self.sink_cfg.env(free_port())


@pytest.fixture(scope="module")
def pipeline(tls: TlsServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """Relay (mTLS to both) and sink (verify-full, SASL_SSL) against the engine stub."""
    logs = tmp_path_factory.mktemp("tls-pipeline")
    unique = uuid.uuid4().hex[:10]
    relay_cfg = RelayConfig(
        db_dsn=tls.relay_dsn(),
        kafka=tls.broker.ssl_bootstrap,
        unique=unique,
        partitions=2,
        extra=tls.kafka_ssl(),
    )
    with StubServer(api_key=API_KEY) as stub:
        sink_relay_cfg = RelayConfig(
            db_dsn=tls.sink_dsn(),
            kafka=tls.broker.sasl_ssl_bootstrap,
            unique=unique,
            partitions=2,
            extra=tls.kafka_sasl(),
        )
        sink_cfg = SinkConfig(relay=sink_relay_cfg, engine_url=stub.url, api_key=API_KEY)
        relay, relay_port = start_relay(relay_cfg, logs)
        try:
            sink, _ = start_sink(sink_cfg, logs)
        except BaseException:
            relay.close()
            raise
        try:
            yield Pipeline(relay_cfg, sink_cfg, relay, relay_port, sink, stub)
        finally:
            for proc in (sink, relay):
                if proc.alive():
                    proc.terminate()
                proc.close()
            assert_no_secret(relay.log_path.read_text(), sink.log_path.read_text())


@pytest.fixture(scope="module")
def delivered(tls: TlsServices, pipeline: Pipeline) -> list[str]:
    """:data:`USERS` events written to the outbox (over TLS) and applied by the engine."""
    with psycopg.connect(tls.sink_dsn()) as conn:
        written = [
            str(register_user(conn, email=f"{uuid.uuid4()}@tls.test", display_name="T").event_id)
            for _ in range(USERS)
        ]

    def applied() -> bool:
        ids = {item["event_id"] for item in pipeline.stub.applied()["items"]}
        return ids >= set(written)

    wait_until(applied, DELIVERY_TIMEOUT_S, "the events at the engine", interval_s=0.5)
    return written


# --- the pipeline over TLS ------------------------------------------------------------------


def test_events_reach_the_engine_over_tls_postgres_and_kafka(
    tls: TlsServices, pipeline: Pipeline, delivered: list[str]
) -> None:
    applied = [i for i in pipeline.stub.applied()["items"] if i["event_id"] in set(delivered)]
    assert sorted(i["event_id"] for i in applied) == sorted(delivered)  # each once
    # The relay streamed over TLS, authenticated by its certificate: what the server holds.
    with psycopg.connect(tls.node.socket_dsn()) as conn:
        row = conn.execute(
            "SELECT s.ssl, s.client_dn, r.usename FROM pg_stat_replication r"
            " JOIN pg_stat_ssl s USING (pid)"
        ).fetchone()
    assert row == (True, f"/CN={RELAY_ROLE}", RELAY_ROLE)
    assert pipeline.relay.alive() and pipeline.sink.alive()


def test_the_relays_backlog_guard_reads_the_sinks_group_over_ssl(
    pipeline: Pipeline, delivered: list[str]
) -> None:
    """``/backlog?group=`` reads committed offsets with the relay's KAFKA_CONFIG_* (SSL):
    ``unknown`` if its Kafka client could not."""
    url = f"http://127.0.0.1:{pipeline.relay_port}/backlog?group={pipeline.sink_cfg.group}"

    def state() -> str:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return str(json.loads(resp.read())["state"])

    assert wait_until(lambda: state() == "ok", 60, "/backlog ok", interval_s=1)


def test_no_password_or_key_passphrase_in_the_relays_and_sinks_logs(
    pipeline: Pipeline, delivered: list[str]
) -> None:
    for proc in (pipeline.relay, pipeline.sink):
        log = proc.log_path.read_text()
        assert "outbox" in log  # (the log is there)
        assert_no_secret(log)


def test_check_passes_over_tls_with_client_certificates_and_over_sasl_ssl(
    pipeline: Pipeline,
) -> None:
    engine = {"ENGINE_BASE_URL": pipeline.stub.url, "INTERNAL_API_KEY": API_KEY}
    runs = cli_all(
        ({**pipeline.relay_env(), **engine}, ("check", "--json")),
        (pipeline.sink_env(), ("check", "--json")),
    )
    for done in runs:
        assert done.returncode == 0, done.stdout + done.stderr
        found = findings(done)
        assert found["postgresql"][0] == "ok" and found["kafka"][0] == "ok", found
        assert_no_secret(done.stdout, done.stderr)
    # the relay's least-privileged role passes every PostgreSQL item too
    assert findings(runs[0])["replication privilege"] == ("ok", "REPLICATION")


def test_slot_status_and_lag_read_over_tls(pipeline: Pipeline, delivered: list[str]) -> None:
    status, lag = cli_all(
        (pipeline.relay_env(), ("slot", "status", "--json")),
        (pipeline.sink_env(), ("lag", "--group", pipeline.sink_cfg.group, "--json")),
    )
    assert status.returncode == 0, status.stdout + status.stderr
    slot = json.loads(status.stdout)
    assert (slot["slot"], slot["exists"], slot["active"]) == (pipeline.relay_cfg.slot, True, True)
    assert lag.returncode == 0, lag.stdout + lag.stderr
    report = json.loads(lag.stdout)
    assert report["kafka"]["readable"] is True and report["slot"]["active"] is True
    ours = [
        p for p in report["partitions"] if p["topic"].startswith(pipeline.relay_cfg.topic_prefix)
    ]
    assert sum(p["end_offset"] for p in ours) >= len(delivered)  # produced over SSL, read here
    assert_no_secret(status.stdout, status.stderr, lag.stdout, lag.stderr)


# --- wrong settings: one clear line each, no secret -----------------------------------------


PG_FAILURES = {
    "a CA that did not sign the server's certificate": (
        lambda t: t.relay_dsn(sslrootcert=str(t.other.ca_cert)),
        "certificate verify failed",
    ),
    "a host name the certificate does not name": (
        lambda t: t.relay_dsn(host="db.elsewhere.test", hostaddr="127.0.0.1"),
        'does not match host name "db.elsewhere.test"',
    ),
    "no client certificate where one is required": (
        lambda t: t.relay_dsn(sslcert="", sslkey="", sslpassword=""),
        "connection requires a valid client certificate",
    ),
    "a wrong key passphrase": (
        lambda t: t.relay_dsn(sslpassword="not the phrase"),
        "could not load private key file",
    ),
    "a client without TLS": (
        lambda t: t.sink_dsn(sslmode="disable"),
        "no encryption",
    ),
}


@pytest.mark.parametrize("case", list(PG_FAILURES))
def test_a_wrong_postgres_tls_setting_is_one_clear_line(tls: TlsServices, case: str) -> None:
    make_dsn, expected = PG_FAILURES[case]
    env = _env(make_dsn(tls), tls.kafka_ssl())
    done, checked = cli_all((env, ("slot", "status")), (env, ("check",)))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = error_lines(done)
    assert len(lines) == 1 and expected in lines[0], done.stderr
    print(f"{case}: {lines[0]}")
    assert "Traceback" not in done.stderr
    assert checked.returncode == 1
    pg_lines = [line for line in error_lines(checked) if line.startswith("error: postgresql:")]
    assert len(pg_lines) == 1 and expected in pg_lines[0], checked.stderr
    assert_no_secret(done.stdout, done.stderr, checked.stdout, checked.stderr)


KAFKA_FAILURES = {
    "a CA that did not sign the broker's certificate": (
        lambda t: t.kafka_ssl(KAFKA_CONFIG_SSL_CA_LOCATION=str(t.other.ca_cert)),
        "certificate verify failed: the broker's certificate is not trusted",
    ),
    "no client certificate where one is required": (
        lambda t: t.kafka_ssl(
            KAFKA_CONFIG_SSL_CERTIFICATE_LOCATION="",
            KAFKA_CONFIG_SSL_KEY_LOCATION="",
            KAFKA_CONFIG_SSL_KEY_PASSWORD="",
        ),
        "the broker refused the client's certificate",
    ),
    "a plaintext client at the SSL listener": (
        lambda t: {"KAFKA_BOOTSTRAP_SERVERS": t.broker.ssl_bootstrap},
        "is a TLS listener and the client speaks plaintext",
    ),
    "a TLS client at a plaintext listener": (
        lambda t: t.kafka_ssl(KAFKA_BOOTSTRAP_SERVERS=t.broker.plaintext_bootstrap),
        "the listener does not speak TLS",
    ),
    "a wrong SASL password": (
        lambda t: t.kafka_sasl(KAFKA_CONFIG_SASL_PASSWORD="not the password"),
        "Authentication failed",
    ),
}


@pytest.mark.parametrize("case", list(KAFKA_FAILURES))
def test_a_wrong_kafka_tls_setting_is_one_clear_line(tls: TlsServices, case: str) -> None:
    make_kafka, expected = KAFKA_FAILURES[case]
    env = _env(tls.sink_dsn(), make_kafka(tls))
    done, checked = cli_all((env, ("lag", "--group", "outbox-cdc-tls-nobody")), (env, ("check",)))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = error_lines(done)
    assert len(lines) == 1 and expected in lines[0], done.stderr
    print(f"{case}: {lines[0]}")
    assert "Traceback" not in done.stderr
    assert checked.returncode == 1
    kafka_lines = [line for line in error_lines(checked) if line.startswith("error: kafka")]
    assert len(kafka_lines) == 1 and expected in kafka_lines[0], checked.stderr
    assert_no_secret(done.stdout, done.stderr, checked.stdout, checked.stderr)


def _errors_counted(port: int, code: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^outbox_relay_kafka_errors_total\{{code="{code}"\}} (\S+)$', text, re.M)
    return found is not None and float(found[1]) > 0


def _readyz(port: int) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError:
        return None, ""


RELAY_FAILURES = {
    "PostgreSQL's certificate": (
        lambda t: (t.relay_dsn(sslrootcert=str(t.other.ca_cert)), t.kafka_ssl()),
        None,
    ),
    "the broker's certificate": (
        lambda t: (t.relay_dsn(), t.kafka_ssl(KAFKA_CONFIG_SSL_CA_LOCATION=str(t.other.ca_cert))),
        "_SSL",
    ),
}


@pytest.mark.parametrize("case", list(RELAY_FAILURES))
def test_a_relay_that_cannot_verify_a_certificate_logs_why_and_is_not_ready(
    tls: TlsServices, tmp_path: Path, case: str
) -> None:
    make, counted = RELAY_FAILURES[case]
    dsn, kafka = make(tls)
    cfg = RelayConfig(
        db_dsn=dsn, kafka=tls.broker.ssl_bootstrap, unique=uuid.uuid4().hex[:10], extra=kafka
    )
    relay, port = start_relay(cfg, tmp_path, wait_ready=False)
    try:
        wait_until(
            lambda: "certificate verify failed" in relay.log_path.read_text(),
            60,
            "the relay's log line",
            interval_s=0.5,
        )
        if counted:
            wait_until(lambda: _errors_counted(port, counted), 30, f"{counted} errors counted")
        status, body = _readyz(port)
        print(f"{case}: /readyz {status} {body}")
        assert status == 503, body
        if counted:  # the broker refused: /readyz names it, not a bare "starting" (issue 39)
            assert "kafka unreachable: " in body and "certificate verify failed" in body, body
    finally:
        relay.close()
    log = relay.log_path.read_text()
    # rate-limited: the handshake is retried several times a second, logged a few times
    assert 1 <= log.count("certificate verify failed") <= 5, log
    assert_no_secret(log)
