"""Keep-alive connections the engine resets between requests (issue 35, item 5).

The stub's ``reset_after_response`` mode resets (RST) each engine answer's
connection a moment after the answer, unless another request came on it: a
load balancer or an engine dropping idle keep-alive connections. Whatever the
timing of that reset against the client's next use of the connection, no
delivery may fail for it, so no attempt is ever spent: the pool drops a
connection it finds reset at checkout, and resends a request whose connection
was reset before any byte of its answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from sinks.engine.client import EngineClient
from sinks.stub.server import StubServer
from tests.harness import (
    RelayConfig,
    SinkConfig,
    create_topics,
    group_caught_up,
    produce,
    start_sink,
    wait_until,
)
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.integration

USERS_SYNC = "/api/internal/users/sync"
RECORDS = 3_000
PARTITIONS = 4


def _request(event_id: str) -> bytes:
    body = json.dumps({"user_id": str(uuid.uuid4())}).encode()
    return (
        f"POST {USERS_SYNC} HTTP/1.1\r\nhost: stub\r\nx-api-key: {API_KEY}\r\n"
        f"idempotency-key: {event_id}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_the_stub_resets_an_idle_keep_alive_connection_after_its_answer(
    stub: StubServer,
) -> None:
    """The fault mode itself: the answer is complete, then the idle connection gets an RST."""
    stub.add_faults({"reset_after_response": {"delay_ms": 50, "for_s": 30}})
    with socket.create_connection(("127.0.0.1", stub.port), timeout=10) as sock:
        sock.sendall(_request(str(uuid.uuid4())))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, "closed before the answer was complete"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass
    stats = stub.stats()
    assert (stats["applied"], stats["connections_reset"]) == (1, 1)


def test_an_engine_client_reusing_connections_the_engine_resets_loses_no_delivery(
    stub: StubServer,
) -> None:
    """Edge: resets landing at every moment of the clients' reuse (16 senders, pauses that
    sweep across the reset delay) - every request answered, none fails, each applied once."""
    stub.add_faults({"reset_after_response": {"delay_ms": 1, "for_s": 120}})
    event_ids = [str(uuid.uuid4()) for _ in range(1_600)]

    async def deliver_all() -> tuple[int, int]:
        async with EngineClient(base_url=stub.url, api_key=API_KEY, max_in_flight=16) as engine:

            async def sender(mine: list[str]) -> None:
                for n, event_id in enumerate(mine):
                    await engine.sync_user(str(uuid.uuid4()), event_id=event_id)
                    await asyncio.sleep((n % 5) * 0.0005)  # 0 to 2 ms: around the reset

            await asyncio.gather(*(sender(event_ids[i::16]) for i in range(16)))
            pool = engine._pool
            assert pool is not None
            return pool.stale_checkouts, pool.stale_retries

    checkouts, retries = asyncio.run(deliver_all())
    stats = stub.stats()
    print(
        f"\n{stats['connections_reset']} resets: {checkouts} dropped at checkout, {retries} resent"
    )
    assert stats["connections_reset"] > 100, "the fault did not happen often enough to matter"
    assert (stats["applied"], stats["duplicates"]) == (len(event_ids), 0)


def _metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text


def test_a_sink_whose_engine_resets_keep_alive_connections_spends_no_attempt(
    db_dsn: str, kafka_bootstrap: str, unique: str, stub: StubServer, tmp_path: Path
) -> None:
    """Real Kafka, PostgreSQL and the sink process: every record delivered once, nothing
    parked, not one retry of any kind (a reset never became a failed delivery)."""
    topics = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique)
    topic = topics.topic_prefix + "user"
    create_topics(kafka_bootstrap, [topic], partitions=PARTITIONS)
    stub.add_faults({"reset_after_response": {"delay_ms": 1, "for_s": 600}})
    records = []
    for _ in range(RECORDS):
        user = str(uuid.uuid4())
        headers = {"id": str(uuid.uuid4()).encode(), "type": b"UserRegistered"}
        records.append((user.encode(), json.dumps({"user_id": user}).encode(), headers))
    produce(kafka_bootstrap, topic, records)
    cfg = SinkConfig(relay=topics, engine_url=stub.url, api_key=API_KEY)
    sink, port = start_sink(cfg, tmp_path)
    try:
        wait_until(lambda: stub.stats()["applied"] == RECORDS, 240, "all applied", 1.0)
        wait_until(lambda: group_caught_up(kafka_bootstrap, cfg.group, [topic]), 60, "commits")
        metrics = _metrics(port)
    finally:
        sink.close()
    stats = stub.stats()
    print(f"\n{stats['connections_reset']} connections reset under {RECORDS} deliveries")
    assert stats["connections_reset"] > 50, "the fault did not happen often enough to matter"
    assert (stats["applied"], stats["duplicates"]) == (RECORDS, 0)
    retried = [
        line for line in metrics.splitlines() if line.startswith("outbox_sink_retried_total")
    ]
    assert retried == [], f"deliveries retried: {retried}"
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM failed_sync_events WHERE kafka_topic = %s", (topic,)
        ).fetchone()
    assert row == (0,)
