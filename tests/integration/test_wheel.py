"""The shipped artifact: a wheel installed into a fresh virtualenv, run with no checkout.

The wheel is built from this checkout (``pip wheel --no-build-isolation``),
installed into a new virtualenv (``uv pip install``) with exactly the pins of
``compose/requirements.lock`` (from a local wheelhouse under ``.dev/wheelhouse``, filled
from PyPI once and reused, so the install needs no network afterwards), and
run from a directory outside the checkout:

* ``outbox-cdc migrate`` creates the schema in an empty database (the
  migrations travel inside the wheel);
* migrate, relay, sink and a TLS engine stub (a private CA, client
  certificates required) run end to end, and no log line of that run holds a
  secret: the database password (in a key=value DSN with spaces and quotes),
  the API key or the admin token. Every log line is one JSON object, uvicorn's
  included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from cdc.outbox import register_user, submit_quiz_attempt
from tests.conftest import DB_PASSWORD, ROOT, PasswordDb
from tests.harness import (
    drop_slot,
    free_port,
    http_status,
    wait_until,
    without_derived_user_syncs,
)
from tests.pki import Pki, make_pki

pytestmark = pytest.mark.integration

WHEELHOUSE = ROOT / ".dev" / "wheelhouse"
LOCK = ROOT / "compose" / "requirements.lock"
API_KEY = "wheel-api-key-5f0e8a"
ADMIN_TOKEN = "wheel-admin-token-77c1d2"
INSTALL_TIMEOUT_S = 600


@dataclass(frozen=True)
class Installed:
    """A fresh virtualenv holding the wheel and its pinned dependencies."""

    venv: Path
    wheel: Path
    install_s: float

    @property
    def cli(self) -> str:
        return str(self.venv / "bin" / "outbox-cdc")


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc  # type: ignore[no-any-return]


def _fill_wheelhouse() -> None:
    """Download the locked wheels once (PyPI); later runs find them all locally."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "--require-hashes",
            "-r",
            str(LOCK),
            "-d",
            str(WHEELHOUSE),
        ],
        timeout=INSTALL_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    started = time.monotonic()
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*build, "-w", str(base / "dist"), str(ROOT)], timeout=INSTALL_TIMEOUT_S)
    (wheel,) = (base / "dist").glob("outbox_cdc-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    # uv installs the ~30 locked wheels in about a second where pip takes tens of seconds
    pip = [str(Path(sys.executable).parent / "uv"), "pip", "install", "-q"]
    pip += ["--python", str(venv / "bin" / "python")]
    local = ["--no-index", "--find-links", str(WHEELHOUSE)]
    try:
        _run([*pip, *local, "--require-hashes", "-r", str(LOCK)], timeout=INSTALL_TIMEOUT_S)
    except AssertionError:
        _fill_wheelhouse()  # first run on this machine (or the lock changed)
        _run([*pip, *local, "--require-hashes", "-r", str(LOCK)], timeout=INSTALL_TIMEOUT_S)
    _run([*pip, "--no-deps", str(wheel)], timeout=INSTALL_TIMEOUT_S)
    took = time.monotonic() - started
    print(f"\nwheel built and installed into a fresh venv in {took:.1f} s")
    return Installed(venv, wheel, took)


def _clean_env(**settings: str) -> dict[str, str]:
    """A process environment with nothing of the checkout (no PYTHONPATH, no venv)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TZ") if k in os.environ}
    env.update(settings)
    return env


def test_the_wheel_carries_the_migrations(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    shipped = {n for n in names if n.startswith("cdc/sql/") and n.endswith(".sql")}
    expected = {f"cdc/sql/{p.relative_to(ROOT / 'sql')}" for p in (ROOT / "sql").rglob("*.sql")}
    assert shipped == expected
    assert not any(n.startswith(("tests/", "sql/")) for n in names)


def test_installed_wheel_migrates_an_empty_database(
    installed: Installed, empty_db_dsn: str, tmp_path: Path
) -> None:
    env = _clean_env(CDC_PG_DSN=empty_db_dsn)
    first = _run([installed.cli, "migrate"], env=env, cwd=tmp_path, timeout=120)
    assert "applied migrations: 001, 003" in first.stdout
    assert {"outbox", "failed_sync_events"} <= _public_tables(empty_db_dsn)
    assert not {"users", "quiz_attempts"} & _public_tables(empty_db_dsn)  # the demo's
    again = _run([installed.cli, "migrate"], env=env, cwd=tmp_path, timeout=120)
    assert "schema is up to date" in again.stdout
    demo = _run([installed.cli, "migrate", "--demo"], env=env, cwd=tmp_path, timeout=120)
    assert "applied migrations: 002" in demo.stdout
    assert {"users", "quiz_attempts"} <= _public_tables(empty_db_dsn)


def _public_tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r[0] for r in rows.fetchall()}


# --- the whole pipeline from the wheel --------------------------------------------


@dataclass
class Child:
    """A process of the installed CLI with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _start(
    installed: Installed, name: str, args: list[str], env: dict[str, str], cwd: Path
) -> Child:
    log = cwd / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [installed.cli, *args], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
        )
    return Child(name, proc, log)


def _wait_ready(child: Child, port: int) -> None:
    def ready() -> bool:
        if child.proc.poll() is not None:
            raise AssertionError(f"{child.name} exited:\n{child.text()[-3000:]}")
        return http_status(f"http://127.0.0.1:{port}/readyz") == 200

    try:
        wait_until(ready, 90, f"{child.name} /readyz")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{child.text()[-3000:]}") from None


def _stub_get(url: str, pki: Pki, endpoint: str) -> dict[str, object]:
    with urllib.request.urlopen(url + endpoint, timeout=10, context=pki.client_context()) as r:
        result: dict[str, object] = json.loads(r.read())
    return result


def test_installed_wheel_runs_migrate_relay_and_sink_to_a_tls_engine_without_logging_secrets(
    installed: Installed,
    password_db: PasswordDb,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    dsn = password_db.keyvalue_dsn
    pki = make_pki(tmp_path / "pki")
    unique = uuid.uuid4().hex[:10]
    stub_port, relay_port, sink_port = free_port(), free_port(), free_port()
    stub_url = f"https://127.0.0.1:{stub_port}"
    common = {
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "DEBUG",
        "INTERNAL_API_KEY": API_KEY,
    }
    app = _clean_env(
        **common,
        CDC_PG_DSN=dsn,
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        CDC_SLOT=f"slot_{unique}",
        CDC_TOPIC_PREFIX=f"w{unique}.outbox.event.",
        CDC_DLQ_TOPIC=f"w{unique}.dlq",
        CDC_TOPIC_PARTITIONS="2",
        SINK_GROUP_ID=f"wheel-{unique}",
        ADMIN_API_TOKEN=ADMIN_TOKEN,
        ENGINE_BASE_URL=stub_url,
        ENGINE_CA_FILE=str(pki.ca_cert),
        ENGINE_CLIENT_CERT=str(pki.client_cert),
        ENGINE_CLIENT_KEY=str(pki.client_key),
        OUTBOX_SCHEDULER_ENABLED="false",
    )
    _run([installed.cli, "migrate", "--demo"], env=app, cwd=tmp_path, timeout=120)
    stub_env = _clean_env(
        **common,
        ENGINE_STUB_PORT=str(stub_port),
        ENGINE_STUB_TLS_CERT=str(pki.server_cert),
        ENGINE_STUB_TLS_KEY=str(pki.server_key),
        ENGINE_STUB_CLIENT_CA=str(pki.ca_cert),
    )
    children: list[Child] = []
    try:
        stub = _start(installed, "stub", ["engine-stub"], stub_env, tmp_path)
        children.append(stub)
        wait_until(lambda: _stub_up(stub_url, pki, stub), 30, "TLS stub")
        relay = _start(
            installed, "relay", ["relay"], {**app, "CDC_RELAY_HTTP_PORT": str(relay_port)}, tmp_path
        )
        children.append(relay)
        _wait_ready(relay, relay_port)
        sink = _start(
            installed, "sink", ["sink"], {**app, "SINK_HTTP_PORT": str(sink_port)}, tmp_path
        )
        children.append(sink)
        _wait_ready(sink, sink_port)
        ids, attempts = [], []
        with psycopg.connect(dsn) as conn:
            for n in range(5):
                user = register_user(conn, email=f"{unique}-{n}@wheel.example", display_name="W")
                ids.append(str(user.event_id))
                attempt = submit_quiz_attempt(conn, user_id=user.entity_id, quiz_id="q1", score=n)
                attempts.append(str(attempt.event_id))
        ids += attempts

        def applied_items() -> list[dict[str, object]]:
            items: list[dict[str, object]] = _stub_get(stub_url, pki, "/_stub/applied")["items"]  # type: ignore[assignment]
            return items

        wait_until(
            lambda: set(ids) <= {item["event_id"] for item in applied_items()},
            90,
            "every event applied by the TLS stub",
        )
        applied = without_derived_user_syncs(applied_items(), attempts)
        assert sorted(str(item["event_id"]) for item in applied) == sorted(ids)
        assert sink.stop() == 0, sink.text()[-3000:]
        assert relay.stop() == 0, relay.text()[-3000:]
    finally:
        for child in reversed(children):
            child.stop()
        drop_slot(dsn, f"slot_{unique}")
    logs = {child.name: child.text() for child in children}
    secrets = [
        DB_PASSWORD,
        "s3cr3t",
        API_KEY,
        ADMIN_TOKEN,
        pki.client_key.read_text().splitlines()[1],
    ]
    for name, text in logs.items():
        for secret in secrets:
            assert secret not in text, f"{name} log holds a secret"
        for line in text.splitlines():
            json.loads(line)  # every line one JSON object
    assert "password=***" in logs["relay"]  # the start-up summary, redacted
    uvicorn_lines = [
        json.loads(line) for line in logs["sink"].splitlines() if '"logger":"uvicorn' in line
    ]
    assert uvicorn_lines, "uvicorn's lines go through the JSON formatter"


def _stub_up(url: str, pki: Pki, stub: Child) -> bool:
    if stub.proc.poll() is not None:
        raise AssertionError(f"stub exited:\n{stub.text()[-3000:]}")
    try:
        return _stub_get(url, pki, "/healthz") == {"status": "ok"}
    except OSError:
        return False
