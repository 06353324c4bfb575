"""The WAL side of the kernel: LSN arithmetic, replication protocol, pgoutput decoder, stream.

What it is for: reading committed changes out of PostgreSQL. :mod:`.lsn`
(LSN text and the :class:`~cdc.wal.lsn.LsnTracker` that decides what may be
confirmed), :mod:`.replproto` (CopyData framing: XLogData, keepalives, status
updates) and :mod:`.pgoutput` (the logical decoding messages) are pure
functions over bytes; :mod:`.stream` is the thin shell around the replication
connection, :mod:`.slots` reads the server's identity and the slot's health and
makes a slot with an exported snapshot. What it may import: the kernel's
constants and errors only - never the relay, Kafka or :mod:`sinks`.
Invariants: the confirmed LSN only ever advances, and only past transactions
whose every record is acknowledged (:class:`~cdc.wal.lsn.LsnTracker`);
malformed bytes raise :class:`cdc.errors.DecodeError`, never a silent skip.
"""
