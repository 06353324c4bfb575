"""Streaming: the relay's loop and the path of one record from the WAL to Kafka.

What it is for: :mod:`.loop` (the :class:`~cdc.relay.stream.loop.Relay`: sessions,
back-pressure, shutdown; it holds one collaborator per role, never inherits one),
:mod:`.fast_path` (the read turn: pgoutput changes to records), :mod:`.producing` (the
producer and its delivery reports), :mod:`.dead_letters` (a row that cannot be routed,
parked with its reason), :mod:`.mode` (the delivery mode's points, the one object the
loop hands over to; a table names each) and :mod:`.at_least_once` (the default mode).
Imports: :mod:`cdc.relay.gaps`, :mod:`cdc.relay.standby`, :mod:`cdc.relay.health` and
the kernel; never :mod:`cdc.relay.delivery` (the exactly-once mode is given to the
loop, not the other way).
"""
