"""Issue 47 items 4 and 7: lag that tells the truth, against real Kafka, PostgreSQL and the stub.

* an exactly-once relay ends every Kafka transaction with a control marker after its
  last record: once the sink has delivered everything, ``outbox-cdc lag --json``
  says total 0 and ``outbox_sink_consumer_lag`` is 0 (the commit is the consumer's
  position, past the marker; it was last record + 1: lag 1 per partition forever);
* ``lag --json`` with Kafka unreachable says the totals are unknown (``null``) and
  exits non-zero (it printed totals of 0: "no lag").
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdc.outbox import register_user
from sinks.stub.server import StubServer
from tests.harness import (
    ROOT,
    RelayConfig,
    SinkConfig,
    drop_slot,
    free_port,
    start_relay,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration

USERS = 60
CLI = (sys.executable, "-m", "cdc.cli")


@pytest.fixture
def eos_cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        partitions=3,
        extra={"CDC_DELIVERY": "exactly-once", "CDC_TX_MAX_MS": "200"},
    )
    yield cfg
    drop_slot(db_dsn, cfg.slot)


def _lag_json(env: dict[str, str], group: str) -> tuple[int, dict[str, object]]:
    done = subprocess.run(
        [*CLI, "lag", "--json", "--group", group],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def _consumer_lag(port: int) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "outbox_sink_consumer_lag":
                return float(sample.value)
    return None


def test_an_exactly_once_drain_shows_lag_0_in_lag_json_and_the_gauge(
    eos_cfg: RelayConfig, stub: StubServer, tmp_path: Path
) -> None:
    relay, _ = start_relay(eos_cfg, tmp_path)
    sink_cfg = SinkConfig(relay=eos_cfg, engine_url=stub.url, api_key=API_KEY)
    sink, sink_port = start_sink(sink_cfg, tmp_path)
    try:
        with psycopg.connect(eos_cfg.db_dsn, autocommit=True) as conn:
            ids = {
                str(register_user(conn, email=f"u{i}@lag.test", display_name="u").event_id)
                for i in range(USERS)
            }
        wait_until(
            lambda: ids <= {i["event_id"] for i in stub.applied(limit=100_000)["items"]},
            120,
            "every event applied",
            interval_s=0.5,
        )
        env = sink_cfg.env(free_port())
        last: list[object] = []

        def drained() -> bool:
            rc, report = _lag_json(env, sink_cfg.group)
            totals = report["totals"]
            assert isinstance(totals, dict)
            last[:] = [rc, totals, _consumer_lag(sink_port)]
            return rc == 0 and totals["lag"] == 0 and last[2] == 0

        wait_until(drained, 60, "lag 0 in `lag --json` and in the gauge", interval_s=2.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last (rc, totals, gauge): {last}") from None
    finally:
        sink.close()
        relay.close()


def test_lag_json_with_kafka_unreachable_says_unknown_and_fails(
    relay_cfg: RelayConfig, stub: StubServer
) -> None:
    env = SinkConfig(relay=relay_cfg, engine_url=stub.url).env(free_port())
    env["KAFKA_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{free_port()}"  # nothing listens
    rc, report = _lag_json(env, "any-group")
    assert rc != 0
    assert report["totals"] is None, "unknown, never 0 (which reads: no lag)"
    assert report["partitions"] == []
    assert report["kafka"] == {"readable": False, "error": report["kafka"]["error"]}  # type: ignore[index]
