"""The relay: committed outbox inserts from the WAL (pgoutput) into Kafka.

What it is for: the ``outbox-cdc relay`` process. :mod:`.loop` holds the
:class:`~cdc.relay.loop.Relay` (sessions, back-pressure, standby, shutdown),
assembled from one mixin per role: :mod:`.fast_path` (pgoutput changes to
records), :mod:`.producing` (the producer and its delivery reports),
:mod:`.dead_letters`, :mod:`.monitor` (the slot gauges and heartbeat thread),
:mod:`.guard` (the gap check before each session) and :mod:`.standby_safe`
(standby-safe mode; its decisions, pure, in :mod:`.standby_gate`); :mod:`.state` and
:mod:`.metrics` hold what they share. :mod:`.gap` decides (pure) whether the
slot may stream, must be created (first start) or has a gap, and
:mod:`.recovery` closes a gap from the outbox table (also for ``outbox-cdc
slot recover``). What it may import: the
``cdc`` kernel (settings, errors, constants, LSN tracking, the WAL protocol and
decoder, the router, the producer helpers), never :mod:`sinks` and never the
command line. Invariants: the slot's confirmed LSN advances only past
transactions all of whose records Kafka acknowledged (or dead-lettered and
acknowledged); the stream never stalls on one row and never drops one; no error
path ends the process; a slot is created only at a first start, never to
paper over a gap.
"""
