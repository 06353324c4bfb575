"""Kafka for the sink: the consumer group member's thread and what it keeps by itself.

What it is for: :mod:`.worker` (librdkafka on a thread of its own: every consumer
call, records and rebalances handed to the loop), :mod:`.config` (the member's Kafka
settings), :mod:`.offset_expiry` (offsets that retention removed: never skipped
silently), :mod:`.fetch_watch` (a partition that should fetch and does not is
restarted), :mod:`.stall_probe` and :mod:`.lag_monitor` (broker requests on threads
and clients of their own). What it may import: the ``cdc`` kernel,
:mod:`sinks.core`; nothing of the roles above it (the shell in :mod:`sinks.runtime`
drives it). Invariants: no Kafka call blocks the event loop, and a turn of the
consumer's thread waits for the broker in ``consume`` only; an offset is
committed only as the loop says.
"""
