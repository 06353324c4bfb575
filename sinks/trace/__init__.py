"""Where is event X? One view of an event's life: outbox commit -> Kafka -> groups -> engine.

What it is for: ``outbox-cdc trace``. :mod:`.model` holds what a trace finds
and its verdict, pure (records, rows, consumer-group positions, the search
bounds, the partitions a key maps to, :class:`~sinks.trace.model.EventState`);
:mod:`.search` reads the outbox table, Kafka, the groups' committed offsets
and the parking lot to fill it. What it may import: the ``cdc`` kernel and
:mod:`sinks.ops` (its Kafka client and topic selection); never the command
line. Invariants: read-only (no offset moves, no row changes); bounded (from a
time, at most ``max_records`` per partition); nothing found within the bounds
raises :class:`~sinks.trace.model.TraceNotFound` naming the bound to widen.
"""
