"""The way the project builds and uses librdkafka clients (issue 23).

* No module calls ``AdminClient.list_consumer_group_offsets``: on a broker that has
  just started it crashes the process (librdkafka #5040, see :mod:`cdc.kafka.client`).
* Every module that builds a librdkafka client routes its errors and log lines
  through :class:`cdc.kafka.log.KafkaClientEvents` (rate-limited), or takes a
  configuration built that way by its caller.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = {"Consumer", "Producer", "AdminClient"}
#: Modules whose clients take a configuration their caller built with KafkaClientEvents.
CONFIG_FROM_CALLER = {
    "cdc/kafka/client.py",
    "sinks/kafka/worker.py",
    "cdc/relay/delivery/exactly_once.py",  # (the relay's own KafkaClientEvents, self._events)
}


def _sources() -> list[Path]:
    return [p for pkg in ("cdc", "sinks") for p in sorted((ROOT / pkg).rglob("*.py"))]


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                names.add(func.attr)
            elif isinstance(func, ast.Name):
                names.add(func.id)
    return names


def test_no_module_lists_committed_offsets_through_the_admin_client() -> None:
    offenders = [
        str(p.relative_to(ROOT)) for p in _sources() if "list_consumer_group_offsets" in _calls(p)
    ]
    assert offenders == [], "use cdc.kafka.client.CommittedReader (librdkafka #5040)"


def test_every_module_building_a_client_routes_its_logs_through_kafka_client_events() -> None:
    builders = [p for p in _sources() if _calls(p) & CLIENTS]
    assert builders, "no client construction found: the test reads the wrong tree"
    offenders = [
        rel
        for p in builders
        if (rel := str(p.relative_to(ROOT))) not in CONFIG_FROM_CALLER
        and "KafkaClientEvents" not in p.read_text(encoding="utf-8")
    ]
    assert offenders == []
