"""The audit's id sets hold bounded memory whatever the window (issue 49, items 4 and 7). Pure.

* :class:`cdc.audit.ids.IdBuckets` with a small memory budget (spilling to its
  temporary file) holds exactly what one that never spills holds, bucket by bucket,
  over any sequence of adds and bucket blobs (hypothesis);
* a window of :data:`WINDOW_IDS` ids on the table side and as many records on the
  Kafka side, compared (:func:`cdc.audit.compare.compare`): the peak memory the
  comparison allocates - tracemalloc, sides built and compared - stays under
  :data:`BOUND_BYTES`, a fraction of the 2 x 16 bytes per id the sides weigh
  (before issue 49 every id stayed in memory: ~32 MB here, 918 MB of RSS for a
  10,000,000-row audit). The figure is printed; ``make bench`` measures whole runs
  (tests/bench/test_audit_bench.py).
"""

from __future__ import annotations

import os
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.audit.compare import KafkaSide, TableSide, compare
from cdc.audit.ids import BUCKETS, SPILL_BYTES, IdBuckets, bucket_of

#: Ids on each side of the measured comparison (16 MB of ids per side).
WINDOW_IDS = 1_000_000
#: What the comparison may allocate at its peak: the sides' budgets (4 x SPILL_BYTES at
#: most in memory), one bucket's ids as objects (~4,000 per side) and the sets of one
#: bucket - not the 32 MB of ids.
BOUND_BYTES = 4 * SPILL_BYTES + 8 * 1024 * 1024

ids16 = st.binary(min_size=16, max_size=16)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), ids16),
            st.tuples(st.just("blob"), st.lists(ids16, max_size=6)),
        ),
        max_size=60,
    ),
    st.integers(16, 96),
)
def test_a_spilling_set_holds_what_one_in_memory_holds(
    steps: list[tuple[str, object]], budget: int
) -> None:
    spilling, kept = IdBuckets(memory_bytes=budget), IdBuckets(memory_bytes=1 << 40)
    for kind, value in steps:
        if kind == "add":
            assert isinstance(value, bytes)
            spilling.add(value)
            kept.add(value)
        else:
            assert isinstance(value, list)
            for bucket in {bucket_of(v) for v in value}:
                blob = b"".join(v for v in value if bucket_of(v) == bucket)
                spilling.add_bucket_blob(bucket, blob)
                kept.add_bucket_blob(bucket, blob)
    assert len(spilling) == len(kept)
    for bucket in range(BUCKETS):
        assert spilling.ids(bucket) == kept.ids(bucket)
    assert not kept.spilled
    spilling.close()


def test_a_large_windows_comparison_holds_bounded_memory() -> None:
    table = {"t": TableSide()}
    kafka = {"t": KafkaSide()}
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        step = 50_000
        for _ in range(WINDOW_IDS // step):
            blob = os.urandom(16 * step)
            for i in range(0, len(blob), 16):
                id16 = blob[i : i + 16]
                table["t"].judged.add(id16)
                kafka["t"].add(id16, candidate=True)
        got = compare(
            table, kafka, dead_letters=IdBuckets(), pending=IdBuckets(), judge_phantoms=True
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(
        f"\naudit comparison of {WINDOW_IDS:,} rows against {WINDOW_IDS:,} records: peak"
        f" {peak / 2**20:.1f} MiB allocated (bound {BOUND_BYTES / 2**20:.0f} MiB; the ids"
        f" weigh {2 * 16 * WINDOW_IDS / 2**20:.0f} MiB, spilled to disk)"
    )
    assert got.total("in_kafka") == WINDOW_IDS and not len(got.missing)
    assert table["t"].judged.spilled and kafka["t"].ours_in_window.spilled
    assert peak < BOUND_BYTES, f"{peak} bytes at the peak"
