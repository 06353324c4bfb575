"""Fixtures of the sink tests: the engine stub, a relay on per-test names, the sink's config.

Each test gets its own slot, topics and consumer group (``unique``), a fresh
stub engine over real HTTP, and a relay process streaming the session's
database; modules with other needs define fixtures of the same name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from sinks.stub.server import StubServer
from tests.conftest import Services
from tests.harness import Proc, RelayConfig, SinkConfig, drop_slot, start_relay

API_KEY = "test-key"
#: Bound of each step of deleting a module's topics (listing, deletion).
TOPIC_CLEANUP_TIMEOUT_S = 30


def _topic_names(bootstrap: str) -> set[str] | None:
    """The broker's topics (internal ones left out), or None when it does not answer.

    A client per call: one kept through the module would log every broker restart
    of the fault tests into their output.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        listed = admin.list_topics(timeout=TOPIC_CLEANUP_TIMEOUT_S).topics
    except KafkaException:
        return None
    return {name for name in listed if not name.startswith("__")}


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.delete_topics(names, operation_timeout=TOPIC_CLEANUP_TIMEOUT_S)
    for future in futures.values():
        try:
            future.result(timeout=TOPIC_CLEANUP_TIMEOUT_S)
        except KafkaException as exc:  # already gone: nothing left to delete
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


@pytest.fixture(scope="module", autouse=True)
def _module_topics_deleted(services: Services) -> Iterator[None]:
    """The topics a module created are deleted once its processes are gone.

    A broker restart (the fault tests) loads and recovers every partition it holds;
    left in place, the suite's topics made each restart several times slower by the
    time the last fault tests ran. Autouse and module-scoped, this fixture is set up
    before and torn down after every other fixture of the module.
    """
    before = _topic_names(services.kafka_bootstrap)
    yield
    after = _topic_names(services.kafka_bootstrap) if before is not None else None
    if before is not None and after is not None and after - before:
        _delete_topics(services.kafka_bootstrap, sorted(after - before))


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(api_key=API_KEY) as server:
        yield server


@pytest.fixture
def relay_cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=4)
    yield config
    drop_slot(db_dsn, config.slot)


@pytest.fixture
def relay(relay_cfg: RelayConfig, tmp_path: Path) -> Iterator[Proc]:
    proc, _ = start_relay(relay_cfg, tmp_path)
    yield proc
    proc.close()


@pytest.fixture
def sink_cfg(relay_cfg: RelayConfig, stub: StubServer) -> SinkConfig:
    return SinkConfig(relay=relay_cfg, engine_url=stub.url, api_key=API_KEY)
