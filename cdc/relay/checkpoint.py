"""Exactly-once mode's checkpoint topic: where the relay's committed WAL position lives in Kafka.

Guarantees:

* the topic is created compacted, with one partition (one log: a key's last
  value is its newest), before the first checkpoint is produced; it is never
  noted as one of the relay's record topics (its records carry no event, and
  the start-up's tail reads never look at it);
* a checkpoint record is key ``origin`` (``<system>/<timeline>/<slot>``,
  :mod:`cdc.lineage`), value the commit end-LSN as PostgreSQL writes it
  (``0/1A2B3C8``), header ``origin``; it is produced inside the Kafka
  transaction whose records it covers, so it is visible exactly when they are;
* :func:`read_checkpoint` reads the whole partition with
  ``isolation.level=read_committed`` up to its end (the last stable offset:
  nothing of an open or aborted transaction) and judges the newest record of
  the origin's key; it is bounded by :data:`READ_TIMEOUT_S` and raises
  :class:`~cdc.errors.KafkaUnavailableError` past it. Anyone may write to a
  topic, and a checkpoint ahead of the truth makes the relay skip WAL
  transactions that are not in Kafka (loss), so it is evidence the relay must
  verify (:func:`judge`): it counts only when its ``origin`` header (read by
  :class:`cdc.records.RecordReader`) is the key, its value parses as an LSN, and
  that LSN is not beyond the server's WAL position read before it
  (:func:`server_wal_position`: the previous relay was fenced first, so every
  true checkpoint lies at or below it). Otherwise :attr:`Checkpoint.distrusted`
  says why and the relay starts from the slot's confirmed position, as without
  a checkpoint (duplicates possible, never a loss). A checkpoint ahead of the
  truth but within the WAL is caught by the start-up check (the audit's
  comparison with the outbox table re-publishes what is missing).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.kafkalog import KafkaClientEvents
from cdc.pgconn import Use
from cdc.pgconn import connect as pg_connect
from cdc.records import RecordReader
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str, str_to_lsn

log = logging.getLogger("cdc.relay")

#: Longest a start waits to read its checkpoint (the topic is compacted: small).
READ_TIMEOUT_S = 60.0
#: Kafka admin requests (list, create) give up after this.
ADMIN_TIMEOUT_S = 30.0
#: The checkpoint topic's configuration: compacted; segments rolled every 10 minutes
#: (the active segment is never compacted: a start reads at most ~10 minutes of
#: commits plus one value per origin); cleaned at 10 % dirty.
TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    "segment.ms": "600000",
    "min.cleanable.dirty.ratio": "0.1",
}


def checkpoint_topic(settings: Settings) -> str:
    """``CDC_CHECKPOINT_TOPIC``, or ``__outbox_cdc_checkpoints.<prefix>``
    (:func:`cdc.settings.default_checkpoint_topic`: never under the topic prefix)."""
    return settings.checkpoint_topic_name


def _client_config(settings: Settings, purpose: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        "client.id": f"outbox-cdc-{purpose}",
        **KafkaClientEvents(purpose).config(),
        **{
            k: v
            for k, v in settings.kafka_config.items()
            if k.startswith(("security.", "sasl.", "ssl."))
        },
    }


def ensure_checkpoint_topic(settings: Settings) -> str:
    """Create the checkpoint topic (compacted, one partition) unless it exists; its name."""
    topic = checkpoint_topic(settings)
    admin = AdminClient(_client_config(settings, "checkpoint-admin"))
    try:
        if topic in admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics:
            return topic
        new = NewTopic(
            topic,
            num_partitions=1,
            replication_factor=settings.topic_replication_factor,
            config=TOPIC_CONFIG,
        )
        future = admin.create_topics([new], request_timeout=ADMIN_TIMEOUT_S)[topic]
        future.result(timeout=ADMIN_TIMEOUT_S)
        log.info("checkpoint topic %s created (compacted)", topic, extra={"topic": topic})
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise KafkaUnavailableError(f"checkpoint topic {topic}: {exc}") from exc
    return topic


#: The server's WAL position a decoded commit cannot lie beyond: flushed on a primary,
#: replayed on a standby (logical decoding on a standby reads no further).
WAL_POSITION_SQL = (
    "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()"
    " ELSE pg_current_wal_flush_lsn() END)::text"
)


def server_wal_position(settings: Settings) -> int:
    """The server's WAL position now (:data:`WAL_POSITION_SQL`); read after the relay
    before was fenced, so every checkpoint it committed lies at or below it."""
    with pg_connect(settings.pg_dsn.get_secret_value(), Use.QUERY) as conn:
        row = conn.execute(WAL_POSITION_SQL).fetchone()
    if row is None or row[0] is None:
        raise KafkaUnavailableError("the server's WAL position could not be read")
    return str_to_lsn(str(row[0]))


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`read_checkpoint` found: the LSN to skip up to, or why none counts."""

    #: the checkpoint's commit end-LSN; None: none found, or none trusted
    lsn: int | None
    #: why the newest record of the key does not count (``""``: it does, or none was found)
    distrusted: str = ""
    #: where that record lies (``topic[0]@offset``), for the warning
    where: str = ""


@dataclass(frozen=True)
class _Newest:
    """The newest record of the key: what judging it needs (headers read once)."""

    offset: int
    origin: bytes | None
    value: bytes
    unreadable: bool


def judge(newest: _Newest | None, origin: str, wal_bound: int) -> Checkpoint:
    """The checkpoint ``newest`` stands for, verified (see the module docstring). Pure."""
    if newest is None:
        return Checkpoint(None)
    where = f"offset {newest.offset}"
    if newest.unreadable:
        return Checkpoint(None, "its headers cannot be read", where)
    if newest.origin != origin.encode():
        said = "no origin header" if newest.origin is None else "another origin header"
        return Checkpoint(None, f"{said} (not written by this relay)", where)
    try:
        lsn = str_to_lsn(newest.value.decode())
    except (ValueError, UnicodeDecodeError):
        return Checkpoint(None, "its value is no LSN", where)
    if lsn > wal_bound:
        return Checkpoint(
            None,
            f"its LSN {lsn_to_str(lsn)} lies beyond the server's WAL position"
            f" {lsn_to_str(wal_bound)} (a forged record, or a checkpoint of another"
            " cluster's history)",
            where,
        )
    return Checkpoint(lsn)


def read_checkpoint(
    settings: Settings,
    topic: str,
    origin: str,
    *,
    wal_bound: int,
    timeout_s: float = READ_TIMEOUT_S,
) -> Checkpoint:
    """The newest committed checkpoint of ``origin`` in ``topic``, verified against
    ``wal_bound`` (:func:`server_wal_position`) by :func:`judge`."""
    consumer = Consumer(
        {
            **_client_config(settings, "checkpoint"),
            "group.id": f"outbox-cdc-checkpoint-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        newest = _read_to_end(consumer, topic, origin.encode(), timeout_s)
    finally:
        consumer.close()
    return judge(newest, origin, wal_bound)


def _read_to_end(consumer: Consumer, topic: str, key: bytes, timeout_s: float) -> _Newest | None:
    """The newest record of ``key`` (its headers read once, defensively), or None."""
    deadline = time.monotonic() + timeout_s
    reader = RecordReader()
    found: _Newest | None = None
    while time.monotonic() < deadline:
        for msg in consumer.consume(1000, min(1.0, max(deadline - time.monotonic(), 0.01))):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return found
                if err.fatal() or not err.retriable():
                    raise KafkaUnavailableError(f"reading checkpoint topic {topic}: {err}")
                continue
            if msg.key() != key:
                continue
            record = reader.read(msg)  # (the only read of its headers)
            found = _Newest(
                offset=msg.offset() or 0,
                origin=record.header(c.HEADER_ORIGIN) if record is not None else None,
                value=msg.value() or b"",
                unreadable=record is None,
            )
    raise KafkaUnavailableError(
        f"checkpoint topic {topic}: not read to its end within {timeout_s:g}s"
    )


def checkpoint_headers(origin: str) -> list[tuple[str, bytes]]:
    """The headers of a checkpoint record."""
    return [(c.HEADER_ORIGIN, origin.encode())]
