"""The relay's lock-free latency histogram against prometheus_client's own.

``OneWriterHistogram`` replaces ``prometheus_client.Histogram`` on the relay's
hot path (one observation per transaction, no lock). Its exposition must be the
one a ``Histogram`` gives for the same observations (``le`` buckets, cumulative
counts, ``_count`` equal to the ``+Inf`` bucket, ``_sum``), less the
``_created`` sample, so dashboards and alerts read it unchanged.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from cdc.relay.health.metrics import OneWriterHistogram, RelayMetrics

BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
NAME = "outbox_relay_commit_to_ack_seconds"


def exposition(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


@given(
    st.lists(
        st.one_of(
            st.sampled_from(BUCKETS),  # a value equal to a bound counts in that bucket
            st.floats(min_value=0, max_value=120, allow_nan=False),
            st.just(float("inf")),
        ),
        max_size=50,
    )
)
def test_exposition_equals_prometheus_histogram(values: list[float]) -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram(
        NAME, "Transaction commit to Kafka ack", buckets=BUCKETS, registry=reference
    )
    one_writer = OneWriterHistogram(NAME, "Transaction commit to Kafka ack", BUCKETS, ours)
    for value in values:
        histogram.observe(value)
        one_writer.observe(value)
    assert exposition(ours) == exposition(reference)


def test_the_relay_registers_its_latency_histogram() -> None:
    registry = CollectorRegistry()
    RelayMetrics(registry).latency.observe(0.003)
    text = generate_latest(registry).decode()
    assert f'{NAME}_bucket{{le="0.005"}} 1.0' in text
    assert f'{NAME}_bucket{{le="0.002"}} 0.0' in text
    assert f"{NAME}_count 1.0" in text
    assert f"# TYPE {NAME} histogram" in text
