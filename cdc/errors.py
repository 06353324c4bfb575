"""Errors of the ``cdc`` package.

Every error raised on purpose derives from :class:`CdcError`. Retry loops test
the class attribute ``retriable`` instead of listing types::

    CdcError
    ├── ConfigError            bad or missing settings            (not retriable)
    ├── DatabaseSetupError     wal_level, privileges, slot plugin (not retriable)
    ├── MigrationError         a migration file failed            (not retriable)
    ├── DecodeError            malformed pgoutput bytes           (not retriable)
    ├── StreamError            replication connection lost        (retriable)
    │   └── SlotInUseError     another relay streams the slot     (retriable)
    └── KafkaUnavailableError  brokers unreachable / timed out    (retriable)
        ├── KafkaUnreachableError  a command's first contact failed (retriable)
        └── ProducerFatalError librdkafka fatal error: rebuild it (retriable)
"""


class CdcError(Exception):
    """Root of the package's errors."""

    retriable: bool = False


class ConfigError(CdcError):
    """A setting is missing or malformed; the message names the variable."""


class DatabaseSetupError(CdcError):
    """The database cannot serve the relay as configured; the message says the fix."""


class MigrationError(CdcError):
    """A migration file failed; nothing of that file was applied."""


class DecodeError(CdcError):
    """Bytes from the replication stream do not parse as pgoutput."""


class StreamError(CdcError):
    """The replication connection failed; reconnecting may help."""

    retriable = True


class SlotInUseError(StreamError):
    """The slot is active for another process: this relay waits as a standby."""


class KafkaUnavailableError(CdcError):
    """Kafka did not answer in time; the relay applies back-pressure and retries."""

    retriable = True


class ProducerFatalError(KafkaUnavailableError):
    """The producer hit a librdkafka fatal error (e.g. an idempotent producer out of
    sequence): it can never produce again, so the relay purges, closes and rebuilds it."""


class KafkaUnreachableError(KafkaUnavailableError):
    """A command could not reach Kafka at all; the message names the address and
    ``KAFKA_BOOTSTRAP_SERVERS`` (the CLI exits 1: Kafka may be down, not misconfigured)."""
