"""The idempotent consumer's numbers and names, each with its reason."""

from __future__ import annotations

DEFAULT_LEDGER_TABLE = "processed_events"
DEFAULT_PARKING_TABLE = "idempotent_parked_events"
#: Longest event id taken (a uuid is 36): anything longer is bad input, not a key.
MAX_EVENT_ID_CHARS = 200
#: Longest pause between two attempts at one record.
RETRY_BACKOFF_CAP_S = 30.0
#: How long a dead letter may take to be acknowledged before the record is retried.
DEAD_LETTER_TIMEOUT_S = 30.0
#: Ledger rows deleted per statement by :func:`prune_ledger`.
PRUNE_BATCH = 10_000
#: Longest reason text kept in the parking table and a dead letter's header.
MAX_REASON_CHARS = 4_000
#: Advisory lock held while the tables are created (several instances may start at once).
DDL_LOCK_KEY = 0x0B0C_DC00_0011
#: Dead-letter headers beyond the relay's (``dlq.reason``, ``dlq.original.topic``).
HEADER_DLQ_PARTITION = "dlq.original.partition"
HEADER_DLQ_OFFSET = "dlq.original.offset"
HEADER_DLQ_CONSUMER = "dlq.consumer"
#: Producer settings a dead-letter producer takes from the consumer's configuration.
SHARED_PREFIXES = ("bootstrap.servers", "client.", "security.", "sasl.", "ssl.", "socket.")
