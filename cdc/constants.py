"""Named constants, each with the reason for its value.

Values a user may want to change are settings (:mod:`cdc.settings`); these are
the ones that follow from protocols or from the contracts in DESIGN.md.
"""

# --- PostgreSQL -------------------------------------------------------------
#: pgoutput protocol version 1 carries everything we decode (no streaming of
#: in-progress transactions: the relay must only see committed work).
PGOUTPUT_PROTO_VERSION = 1
#: Prefix of transactional logical messages that form the table-less outbox.
OUTBOX_MESSAGE_PREFIX = "outbox"
#: Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
PG_EPOCH_OFFSET_US = 946_684_800_000_000
#: Advisory lock key the migrator holds so two `migrate` runs never interleave.
MIGRATION_LOCK_KEY = 0x0B0C_DC00_0001

# --- Kafka record contract ----------------------------------------------------
HEADER_ID = "id"
HEADER_TYPE = "type"
HEADER_AGGREGATE_TYPE = "aggregatetype"
HEADER_LSN = "lsn"
HEADER_COMMIT_TS = "commit_ts"
HEADER_TRACEPARENT = "traceparent"
#: ``<system_identifier>/<timeline>/<slot>`` of the session that published the
#: record: the relay's memory of where it streamed from (cdc.lineage).
HEADER_ORIGIN = "origin"
#: On records re-published from the outbox table after a slot gap: the gap's id
#: (``verify`` when the start-up check re-published a row missing from Kafka).
HEADER_RECOVERED = "recovered"
#: On records made from a logical message (``pg_logical_emit_message``): ``message``.
#: Rows of the outbox table carry no ``form``. The relay's evidence of which events
#: the table can give back after a slot gap (cdc.relay.gaps.gap).
HEADER_FORM = "form"
FORM_MESSAGE = b"message"
#: Dead-letter headers: why Kafka refused the record and where it came from.
HEADER_DLQ_REASON = "dlq.reason"
HEADER_DLQ_TOPIC = "dlq.original.topic"

# --- Timing -------------------------------------------------------------------
#: Standby status is sent at least this often, well inside the server's default
#: wal_sender_timeout (60 s) and tight enough that confirmed LSN tracks acks.
STATUS_INTERVAL_S = 1.0
#: While Kafka is down the relay still answers keepalives at this period.
BACKPRESSURE_POLL_S = 0.2
#: A standby relay retries taking the slot this often.
STANDBY_RETRY_S = 2.0
