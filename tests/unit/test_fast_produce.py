"""The compiled produce call (cdc.relay._produce): records, reports and refusals as
Producer.produce gives them, on a real confluent-kafka producer with no broker.

Nothing listens where these producers point, so librdkafka fails every record with
a delivery report once ``message.timeout.ms`` passes: a failed report goes through
confluent-kafka's own report callback to the record's callback, which is what the
compiled call must feed. (The records a broker takes are compared byte for byte
with ``Producer.produce``'s in ``tests/integration/test_fast_produce.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer

from cdc.relay import fast_produce
from cdc.router import TxContext
from cdc.wal.pgoutput import PURE_PYTHON_VAR
from tests.conftest import IN_CI

NOWHERE = "127.0.0.1:9"  # discard: nothing listens (connection refused)
ERR_MSG_SIZE_TOO_LARGE = 10


class Runs(list[tuple[int, bytes]]):
    """A run of records' callback, as cdc.relay.producing.Reports: a list of
    (hash of key and value, event id), called with failed reports."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[int, bytes | None, bytes | None, list[Any] | None]] = []

    def __call__(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self.failed.append((err.code(), msg.key(), msg.value(), msg.headers()))


def producer(**config: Any) -> Producer:
    return Producer(
        {
            "bootstrap.servers": NOWHERE,
            "message.timeout.ms": 300,
            "delivery.report.only.error": True,
            "log_level": 0,
            **config,
        }
    )


@pytest.fixture
def fast() -> fast_produce.FastProduce:
    bound = fast_produce.bind(producer(), "rdkafka")
    if bound is None:
        if os.environ.get(PURE_PYTHON_VAR, "").strip() in ("1", "true", "yes"):
            pytest.skip(f"{PURE_PYTHON_VAR} is set: the relay uses Producer.produce")
        message = "cdc.relay._produce is not built or not bound: only Producer.produce was tested"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return bound


TX = TxContext("0/16B3748", 1_764_000_000_123_456)
TX_WITH_ORIGIN = TxContext("0/16B3749", 1_764_000_000_654_321, ("origin", b"cluster-a"))


def test_records_are_counted_on_their_run_and_their_failed_reports_reach_it(
    fast: fast_produce.FastProduce,
) -> None:
    p = producer()
    runs = Runs()
    baseline = sys.getrefcount(runs)
    rows = [
        (b"agg-1", b'{"a": 1}', b"id-1", TX, None),
        (b"agg-2", b'{"b": "\xc3\xa9\x00"}', b"id-2", TX_WITH_ORIGIN, b""),
        (b"agg-1", b"{}", b"id-3", TX, b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]
    for key, value, event_id, tx, trace in rows:
        err = fast(
            p, "t.a", value, key, tx.timestamp_ms, event_id, b"T", b"user", tx.headers, trace, runs
        )
        assert err == 0
    assert list(runs) == [(hash((k, v)), i) for k, v, i, _, _ in rows]
    assert sys.getrefcount(runs) == baseline + len(rows)  # one per record in flight
    assert p.flush(10) == 0  # every report served (each a failure: nothing listens)
    assert sys.getrefcount(runs) == baseline  # confluent-kafka let go of each
    assert [(code, key, value) for code, key, value, _ in runs.failed] == [
        (KafkaError._MSG_TIMED_OUT, key, value) for key, value, *_ in rows
    ]


def test_a_refused_record_leaves_its_run_as_it_was(fast: fast_produce.FastProduce) -> None:
    p = producer(**{"message.max.bytes": 1000})
    runs = Runs()
    args = (TX.timestamp_ms, b"id-1", b"T", b"user", TX.headers, None, runs)
    baseline = sys.getrefcount(runs)
    assert fast(p, "t.a", b"x" * 2000, b"k", *args) == ERR_MSG_SIZE_TOO_LARGE
    assert (list(runs), sys.getrefcount(runs)) == ([], baseline)
    assert fast(p, "t.a", b"{}", b"k2", *args) == 0
    assert p.flush(10) == 0
    assert [(key, value) for _, key, value, _ in runs.failed] == [(b"k2", b"{}")]  # only it


def test_a_full_local_queue_is_its_own_error(fast: fast_produce.FastProduce) -> None:
    p = producer(**{"queue.buffering.max.messages": 1})
    runs = Runs()
    args = (TX.timestamp_ms, b"id-1", b"T", b"user", TX.headers, None, runs)
    assert fast(p, "t.a", b"{}", b"k", *args) == 0
    assert fast(p, "t.a", b"{}", b"k", *args) == fast_produce.ERR_QUEUE_FULL
    assert len(runs) == 1
    assert p.flush(10) == 0
    assert len(runs.failed) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"value": "text"},
        {"key": None},
        {"event_id": "id"},
        {"tx_headers": [("lsn", b"0/1")]},
        {"tx_headers": (("lsn", "0/1"),)},
        {"tx_headers": ((b"lsn", b"0/1"),)},
        {"trace": "00-"},
        {"runs": ()},
        {"producer": object()},
    ],
    ids=lambda bad: next(iter(bad)),
)
def test_arguments_of_the_wrong_type_raise_and_produce_nothing(
    fast: fast_produce.FastProduce, bad: dict[str, Any]
) -> None:
    p = producer()
    args: dict[str, Any] = {
        "producer": p,
        "topic": "t.a",
        "value": b"{}",
        "key": b"k",
        "timestamp_ms": TX.timestamp_ms,
        "event_id": b"id",
        "event_type": b"T",
        "aggtype": b"user",
        "tx_headers": TX.headers,
        "trace": None,
        "runs": Runs(),
    }
    runs = args["runs"]
    args.update(bad)
    with pytest.raises(TypeError):
        fast(*args.values())
    assert p.flush(10) == 0
    assert (list(runs), runs.failed) == ([], [])  # nothing was produced


def test_a_closed_producer_is_a_state_error(fast: fast_produce.FastProduce) -> None:
    p = producer()
    p.close()
    runs = Runs()
    err = fast(p, "t.a", b"{}", b"k", TX.timestamp_ms, b"id", b"T", b"user", TX.headers, None, runs)
    assert err == KafkaError._STATE
    assert list(runs) == []


def test_only_a_confluent_kafka_producer_is_bound() -> None:
    class Fake:
        pass

    assert fast_produce.bind(Fake(), "rdkafka") is None


def test_a_producer_whose_handle_reads_another_name_is_not_bound(
    fast: fast_produce.FastProduce,
) -> None:
    """The layout check: the handle's name must be the client.id's."""
    p = producer(**{"client.id": "relay-x"})
    assert fast_produce.bind(p, "relay-x") is fast
    assert fast_produce.bind(p, "rdkafka") is None


@pytest.mark.parametrize(("value", "bound"), [("1", False), ("0", True)])
def test_the_pure_python_switch_selects_producer_produce(value: str, bound: bool) -> None:
    env = {**os.environ, PURE_PYTHON_VAR: value}
    probe = (
        "from confluent_kafka import Producer; from cdc.relay import fast_produce as f;"
        " print(f.bind(Producer({'bootstrap.servers': '127.0.0.1:9'}), 'rdkafka') is not None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    built = fast_produce._module() is not None or os.environ.get(PURE_PYTHON_VAR)
    assert out == [str(bound and bool(built))]
