"""PostgreSQL (logical) and Kafka (KRaft) of a test session's own, with testcontainers.

``OUTBOX_TEST_SERVICES=testcontainers`` makes the ``services`` fixture start these
instead of using ``make up``'s stack: a contributor with only Docker runs ``pytest``.

* The images are the compose file's (``postgres:16``, ``apache/kafka:4.1.1``): pulled by
  Docker when missing, or the stand-ins of ``compose/standins`` where no registry answers
  (``bash compose/docker.sh images`` builds them).
* Host ports are random, on the loopback (Docker publishes each container port on a free
  port of 127.0.0.1); Kafka
  advertises its published port, learnt once the container exists: the container waits
  for a file naming it, then runs the image's own entrypoint (``/etc/kafka/docker/run``).
* testcontainers' reaper (Ryuk) is an image of its own, which cannot be pulled where no
  registry answers: it is disabled, and the session removes its containers itself - by
  the label :data:`LABEL`, whose value names the session (host and pid). Containers of a
  session whose process is gone (killed, no teardown) are removed when the next starts.
* Each wait is bounded (:data:`START_TIMEOUT_S`); the container's last log lines come
  with a timeout.
"""

from __future__ import annotations

import io
import os
import secrets
import socket
import tarfile
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from testcontainers.core.config import testcontainers_config
from testcontainers.core.container import DockerContainer

#: The images of compose/docker-compose.yml.
POSTGRES_IMAGE = "postgres:16"
KAFKA_IMAGE = "apache/kafka:4.1.1"
#: Containers of a session carry this label; its value is the session (host:pid).
LABEL = "org.outbox-cdc.test-session"
#: Bound of a container's start (first answer of the service), on a busy machine.
START_TIMEOUT_S = 180.0
POLL_S = 0.5
#: Where the Kafka container's command waits for its advertised listeners.
ADVERTISED_FILE = "/tmp/outbox-cdc-advertised"
KAFKA_PORT = 9092
POSTGRES_PORT = 5432
#: Published on the loopback only, on a port Docker picks (docker-py: (address,) = any port).
LOOPBACK = "127.0.0.1"
LOOPBACK_ANY_PORT = (LOOPBACK,)
#: PostgreSQL's settings the relay's tests need (logical decoding, room for many slots).
POSTGRES_COMMAND = (
    "postgres -c wal_level=logical -c max_replication_slots=64 -c max_wal_senders=64"
    " -c max_connections=300"
)


def session_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _docker() -> Any:
    import docker  # type: ignore[import-untyped]

    return docker.from_env()


def docker_answers() -> bool:
    try:
        _docker().ping()
    except Exception:  # no SDK, no socket, no engine: all mean "no Docker here"
        return False
    return True


def remove_session_containers(label_value: str | None = None) -> list[str]:
    """Remove (with their volumes) the containers of a session, or - without a value -
    those of every session of this host whose process is gone. Their names."""
    client = _docker()
    host = socket.gethostname()
    removed = []
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        value = container.labels.get(LABEL, "")
        if label_value is not None:
            if value != label_value:
                continue
        else:
            owner_host, _, pid = value.rpartition(":")
            if owner_host != host or not pid.isdigit() or _alive(int(pid)):
                continue
        container.remove(force=True, v=True)
        removed.append(container.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish_on_loopback(container: DockerContainer, port: int) -> None:
    """Publish ``port`` on a free port of the loopback (testcontainers' own helpers publish
    on every interface; docker-py takes ``(address,)`` for "any port of that address")."""
    container.ports[f"{port}/tcp"] = LOOPBACK_ANY_PORT


def _wait(what: str, ready: Any, container: DockerContainer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            logs = container.get_wrapped_container().logs(tail=30).decode(errors="replace")
            raise TimeoutError(f"{what} not ready after {START_TIMEOUT_S:.0f}s:\n{logs}")
        time.sleep(POLL_S)


@dataclass
class SessionServices:
    """The session's containers and their endpoints."""

    label: str
    pg_dsn: str
    kafka_bootstrap: str
    containers: list[DockerContainer]

    def close(self) -> None:
        for container in self.containers:
            container.stop()
        remove_session_containers(self.label)


def _start_postgres(label: str) -> tuple[DockerContainer, str]:
    password = secrets.token_hex(12)
    container = (
        DockerContainer(POSTGRES_IMAGE)
        .with_env("POSTGRES_USER", "postgres")
        .with_env("POSTGRES_PASSWORD", password)
        .with_env("POSTGRES_DB", "postgres")
        .with_command(POSTGRES_COMMAND)
        .with_kwargs(labels={LABEL: label})
    )
    _publish_on_loopback(container, POSTGRES_PORT)
    container.start()
    host = LOOPBACK
    port = container.get_exposed_port(POSTGRES_PORT)
    dsn = f"postgresql://postgres:{password}@{host}:{port}/postgres"

    def answers() -> bool:
        try:
            with psycopg.connect(dsn, connect_timeout=3) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    _wait("PostgreSQL", answers, container)
    return container, dsn


def _start_kafka(label: str) -> tuple[DockerContainer, str]:
    env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        # the host's listener (advertised on its published port), the broker's own, the
        # controller's: inside the container the broker reaches itself on localhost
        "KAFKA_LISTENERS": "HOST://:9092,BROKER://localhost:9094,CONTROLLER://localhost:9093",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": ",".join(
            f"{name}:PLAINTEXT" for name in ("HOST", "BROKER", "CONTROLLER")
        ),
        "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_HEAP_OPTS": "-Xms256m -Xmx768m",
    }
    container = DockerContainer(KAFKA_IMAGE)
    _publish_on_loopback(container, KAFKA_PORT)
    for key, value in env.items():
        container.with_env(key, value)
    container.with_command(
        [
            "sh",
            "-c",
            f"while [ ! -s {ADVERTISED_FILE} ]; do sleep 0.1; done; "
            f'export KAFKA_ADVERTISED_LISTENERS="$(cat {ADVERTISED_FILE})"; '
            "exec /etc/kafka/docker/run",
        ]
    ).with_kwargs(labels={LABEL: label})
    container.start()
    host = LOOPBACK
    port = container.get_exposed_port(KAFKA_PORT)
    advertised = f"HOST://{host}:{port},BROKER://localhost:9094".encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo(ADVERTISED_FILE.lstrip("/"))
        info.size, info.mode, info.mtime = len(advertised), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(advertised))
    container.get_wrapped_container().put_archive("/", archive.getvalue())
    bootstrap = f"{host}:{port}"

    def answers() -> bool:
        admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 3000})
        try:
            admin.list_topics(timeout=3)
        except Exception:  # KafkaException: not up yet
            return False
        return True

    _wait("Kafka", answers, container)
    return container, bootstrap


def start_session_services() -> SessionServices:
    """PostgreSQL and Kafka of this session (its leftovers of dead sessions removed)."""
    testcontainers_config.ryuk_disabled = True  # its image cannot be pulled here
    remove_session_containers()
    label = session_label()
    started: list[DockerContainer] = []
    try:
        pg, dsn = _start_postgres(label)
        started.append(pg)
        kafka, bootstrap = _start_kafka(label)
        started.append(kafka)
    except BaseException:
        remove_session_containers(label)
        raise
    return SessionServices(label, dsn, bootstrap, started)
