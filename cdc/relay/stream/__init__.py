"""Streaming: the relay's loop and the path of one record from the WAL to Kafka.

What it is for: :mod:`.loop` (the :class:`~cdc.relay.stream.loop.Relay`: sessions,
back-pressure, shutdown), :mod:`.fast_path` (pgoutput changes to records),
:mod:`.producing` (the producer and its delivery reports), :mod:`.dead_letters` (a row
that cannot be routed, parked with its reason). Imports: :mod:`cdc.relay.gaps`,
:mod:`cdc.relay.standby`, :mod:`cdc.relay.health` and the kernel; never
:mod:`cdc.relay.delivery` (the exactly-once relay builds on the loop, not the other way).
"""
