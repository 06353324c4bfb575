"""outbox-cdc: the transactional outbox made real.

Applications commit a business row and an outbox row in one PostgreSQL
transaction (:mod:`cdc.outbox`); the relay (:mod:`cdc.relay`) streams committed
outbox inserts out of the WAL (:mod:`cdc.wal`: logical replication,
``pgoutput``) into Kafka and confirms the slot only behind Kafka's
acknowledgements. ``cdc`` is the relay and the shared kernel (settings, logging,
errors, health, constants, the WAL protocol, the outbox helpers, migrations,
slot operations, the command group :mod:`cdc.cli`); it imports nothing of
:mod:`sinks`, the consumer side, which adds its commands through an entry point.
"""

__version__ = "0.1.0"
