"""The cyclic garbage collector's policy for a process that moves many records.

A process that streams or republishes rows allocates a few dozen short-lived,
acyclic objects per record. With CPython's default thresholds (700, 10, 10) the
collector ran every ~25 records in the relay (~8% of its CPU), and a run that keeps
thousands of records alive for a while - an exactly-once republish holds one Kafka
transaction's records for its redo - promoted the rows in flight at each of those
collections until full collections (a walk of every object of the process) came
every ~17,000 rows: 1.7 s of a million-row repair's 16 (8,228 collections against
an at-least-once run's 29).

:func:`for_bulk_work` is called once a process knows it is one of those (the relay,
the sink, ``outbox-cdc audit``): the objects made so far (modules, settings,
clients) are frozen out of every later collection, and collections come after
:data:`THRESHOLDS`' allocations. Garbage in reference cycles is still collected,
later: a process's memory test (the sink's parking lot) checks that its hot paths
leave none.
"""

from __future__ import annotations

import gc

#: Cyclic-GC thresholds (gen 0 allocations, gen 1 and gen 2 collections) of such a process.
THRESHOLDS = (50_000, 20, 50)


def for_bulk_work() -> None:
    """Freeze what exists, collect less often (idempotent)."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
