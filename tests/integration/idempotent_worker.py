"""A consumer service built on :mod:`sinks.idempotent`, run as a process by the tests.

    python -m tests.integration.idempotent_worker DSN BOOTSTRAP TOPIC GROUP NAME COMMIT_MS

The handler inserts one row per call into ``handled`` (no unique constraint: a
second run of the handler for one event would show as a second row). One line
per processed record goes to stdout, ``<outcome> <event id>``, flushed at once.
SIGTERM stops it cleanly (offsets committed on close).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import psycopg

from sinks.core.delivery import Envelope
from sinks.idempotent import ConsumerOptions, IdempotentConsumer


def handle(conn: psycopg.Connection[Any], record: Envelope) -> None:
    conn.execute(
        "INSERT INTO handled (event_id, value) VALUES (%s, %s)",
        (record.event_id, (record.value or b"").decode()),
    )


def main(dsn: str, bootstrap: str, topic: str, group: str, name: str, commit_ms: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS handled (event_id text, value text)")
        conn.commit()
        consumer = IdempotentConsumer(
            conn,
            handle,
            kafka_config={
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "auto.commit.interval.ms": int(commit_ms),
                # A killed member leaves the group within seconds, not 45 s.
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
            },
            topics=[topic],
            options=ConsumerOptions(name=name, retry_backoff_s=0.1),
        )
        signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
        with consumer:
            while not consumer.stopping:
                done = consumer.poll_once(0.2)
                if done is not None:
                    print(done.outcome.value, done.event_id, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
