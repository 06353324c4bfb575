"""``outbox-cdc check`` against the real PostgreSQL, Kafka and the engine stub over HTTP.

The preflight passes on a migrated database with the right API key (exit 0),
names a topic whose partition count differs from CDC_TOPIC_PARTITIONS (a
warning, still exit 0), and fails (exit 1) with one line naming
INTERNAL_API_KEY when the engine refuses the key; the key never appears. The
engine's state is unchanged by the probe (nothing applied).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from sinks.stub.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "check-test-key"
WRONG_KEY = "not-the-key-0123"


def _check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "KAFKA_", "SINK_"))}
    return subprocess.run(
        [sys.executable, "-m", "cdc.cli", "check", *args],
        env={**base, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_check_passes_warns_of_partitions_and_fails_naming_the_api_key(
    db_dsn: str, kafka_bootstrap: str, unique: str
) -> None:
    prefix = f"chk{unique}.outbox.event."
    topic = f"{prefix}user"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in admin.create_topics([NewTopic(topic, num_partitions=2)]).values():
        future.result(timeout=60)
    with StubServer(api_key=API_KEY) as stub:
        env = {
            "CDC_PG_DSN": db_dsn,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "CDC_SLOT": f"slot_chk_{unique}",
            "CDC_TOPIC_PREFIX": prefix,
            "CDC_TOPIC_PARTITIONS": "3",
            "ENGINE_BASE_URL": stub.url,
            "INTERNAL_API_KEY": API_KEY,
            "ADMIN_API_TOKEN": "t",
        }
        good = _check(env, "--json")
        bad = _check({**env, "INTERNAL_API_KEY": WRONG_KEY})
        applied = stub.stats()["applied"]

    assert good.returncode == 0, good.stdout + good.stderr
    answer = json.loads(good.stdout)
    by_item = {f["item"]: f for f in answer["findings"]}
    assert answer["ok"] is True
    for item in ("settings", "postgresql", "wal_level", "replication privilege", "kafka"):
        assert by_item[item]["status"] == "ok", by_item[item]
    assert by_item["publication"]["status"] == "ok"
    assert by_item[f"slot slot_chk_{unique}"]["status"] == "ok"
    assert by_item["engine"]["status"] == "ok"
    assert "API key accepted" in by_item["engine"]["detail"]
    assert by_item[f"topic {topic}"]["status"] == "warn"
    assert "CDC_TOPIC_PARTITIONS=3" in by_item[f"topic {topic}"]["detail"]

    assert bad.returncode == 1
    errors = bad.stderr.strip().splitlines()
    assert len(errors) == 1, bad.stderr
    assert errors[0].startswith("error: engine:")
    assert "INTERNAL_API_KEY" in errors[0]
    assert WRONG_KEY not in bad.stdout + bad.stderr
    assert API_KEY not in good.stdout + good.stderr
    assert applied == 0  # the probe changed nothing in the engine
