"""outbox-cdc: the transactional outbox made real.

Applications commit a business row and an outbox row in one PostgreSQL
transaction (:mod:`cdc.outbox`); the relay (:mod:`cdc.relay`) streams committed
outbox inserts out of the WAL with logical replication (``pgoutput``) into Kafka
and confirms the slot only behind Kafka's acknowledgements. Delivery to the
engine lives in the sibling package :mod:`sinks`.
"""

__version__ = "0.1.0"
