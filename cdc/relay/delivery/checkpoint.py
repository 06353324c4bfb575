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
* **one checkpoint stream per relay**: the default topic is the relay's own
  (:attr:`cdc.settings.Settings.checkpoint_topic_name`: one per slot; the relay
  and its standby are the only producers of its ``transactional.id``). A
  read_committed read ends at the partition's last stable offset, and an open
  transaction of *any* producer on a partition holds that offset back: on a
  topic shared by sharded relays, another shard's open transaction hid this
  relay's later checkpoints (and a continuously committing shard kept the read
  from ever reaching its end). On its own topic, once ``init_transactions``
  aborted the predecessor's open transaction, nothing of this relay's is
  hidden;
* :func:`read_checkpoint` reads the partition with ``isolation.level=read_committed``
  up to the last stable offset (queried first: it waits at most
  :data:`PREDECESSOR_ABORT_WAIT_S` for the markers of its predecessor's aborted
  transaction, never for another producer's transaction) and judges the
  newest record of the origin's key; it is bounded by :data:`READ_TIMEOUT_S`
  and raises :class:`~cdc.errors.KafkaUnavailableError` past it. Records past
  the last stable offset (another producer's transaction open on the relay's
  own topic: only the relay's principal should write it) are counted
  (:attr:`Checkpoint.hidden`) for a warning and read uncommitted: the relay's
  later checkpoints lie there, and so may those of its own aborted
  transactions, which no read tells apart - but a checkpoint counts only as far
  as the relay's own committed records show it (below), so one of an aborted
  transaction skips nothing that is not in Kafka;
* **upgrade**: when the relay's own topic holds no checkpoint of its key, the
  shared topic every relay of the prefix used before
  (:attr:`cdc.settings.Settings.shared_checkpoint_topic`) is read once, the
  same way (to its last stable offset: another shard's open transaction there
  can only make the checkpoint older); the first commit writes to the relay's
  own topic, which every later start reads;
* **a new timeline inherits, up to its fork**: when the relay's origin (its
  timeline) has no checkpoint yet - the first start after a failover promoted a
  standby - the newest checkpoint of the nearest ancestor timeline that has one
  (``IDENTIFY_SYSTEM``'s timeline history, :attr:`cdc.wal.slots.ServerIdentity.ancestors`)
  is judged under that ancestor's origin and trusted only up to the LSN where
  that timeline ended: the WAL before the fork is the same WAL on both, every
  WAL transaction committed below ``min(checkpoint, fork)`` is the same
  transaction, already in Kafka;
* **a checkpoint counts only as far as the relay's own committed records show
  it** (DESIGN, relay invariant 13; :func:`provable`): the data records of a
  Kafka transaction commit with its checkpoint, so a true checkpoint has the
  relay's own streamed records (``origin`` its own, not ``recovered``, read
  read_committed from the tails of its topics and of the dead-letter topic) at
  the WAL transactions it covers. It is trusted up to the highest ``lsn`` of
  those records - and only of those whose row the outbox table still holds
  (a server rewound on the same timeline, e.g. a restored disk snapshot, lost
  the rows of its later history while Kafka kept their records and checkpoint)
  - or the slot's confirmed position, whichever is higher; beyond it the WAL is
  read again (what is already in Kafka may be published again; nothing is
  lost). Anyone may write to a
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from psycopg import sql

from cdc import constants as c
from cdc.errors import KafkaUnavailableError
from cdc.evidence import Owner, checkpoint_rule
from cdc.kafka.log import KafkaClientEvents
from cdc.lineage import LastRecord, TailTooDeepError, read_tails
from cdc.outbox import table_identifier
from cdc.pgconn import Use
from cdc.pgconn import connect as pg_connect
from cdc.records import RecordReader
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str, str_to_lsn

log = logging.getLogger("cdc.relay")

#: Longest a start waits to read its checkpoint (the topic is compacted: small).
READ_TIMEOUT_S = 60.0
#: Longest a start waits for the last stable offset of its checkpoint topic to reach
#: the topic's end: the markers of the predecessor's transaction its init_transactions
#: aborted are written within moments; a transaction still open after this is another
#: producer's (read past, uncommitted: see :func:`_read_past`).
PREDECESSOR_ABORT_WAIT_S = 5.0
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
    #: the topic it was read from (the relay's own, or the shared one of before)
    topic: str = ""
    #: records of the relay's own topic past its last stable offset when it was read:
    #: another producer's open transaction (0: none; the read never waits for one)
    hidden: int = 0
    #: the ancestor timeline's origin whose checkpoint this is (``""``: the relay's own),
    #: its own LSN, and where that timeline ended (``lsn`` is the lower of the two)
    inherited: str = ""
    inherited_lsn: int = 0
    fork: int = 0


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
    refused = checkpoint_rule(newest.origin, origin)  # (cdc.evidence: this origin exactly)
    if refused is not None:
        return Checkpoint(None, refused, where)
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
    ancestors: Sequence[tuple[str, int]] = (),
    timeout_s: float = READ_TIMEOUT_S,
) -> Checkpoint:
    """The newest committed checkpoint of ``origin`` in ``topic`` (the relay's own), or,
    when it holds none, in the shared topic of before (an upgrade: read once, since
    the first commit writes to ``topic``); verified against ``wal_bound``
    (:func:`server_wal_position`) by :func:`judge`. ``ancestors``: the origins of this
    history's earlier timelines with the LSN where each ended, nearest first - with
    no checkpoint of ``origin``, the nearest one's trusted checkpoint counts, capped at
    its fork (see the module docstring)."""
    keys = [origin, *(name for name, _ in ancestors)]
    newest, hidden = _read_newest(settings, topic, keys, timeout_s)
    source = topic
    shared = settings.shared_checkpoint_topic
    if not newest and shared is not None and shared != topic and _exists(settings, shared):
        newest, _ = _read_newest(settings, shared, keys, timeout_s)
        source = shared
    return choose(newest, origin, ancestors, wal_bound, source=source, hidden=hidden)


def choose(
    newest: dict[str, _Newest],
    origin: str,
    ancestors: Sequence[tuple[str, int]],
    wal_bound: int,
    *,
    source: str = "",
    hidden: int = 0,
) -> Checkpoint:
    """The checkpoint that counts among the newest records read (per origin): the
    relay's own, judged; else the nearest ancestor's, judged under its own origin and
    capped at its fork; else none. Pure."""
    if origin in newest or not newest:
        found = judge(newest.get(origin), origin, wal_bound)
        return Checkpoint(found.lsn, found.distrusted, found.where, source, hidden)
    for name, fork in ancestors:
        if name not in newest:
            continue
        found = judge(newest[name], name, wal_bound)
        if found.lsn is None:
            return Checkpoint(None, found.distrusted, found.where, source, hidden, name, 0, fork)
        lsn = min(found.lsn, fork)
        return Checkpoint(lsn, "", found.where, source, hidden, name, found.lsn, fork)
    return Checkpoint(None, "", "", source, hidden)


def provable(
    checkpoint: int,
    *,
    confirmed: int,
    streamed: int,
    rows: Sequence[tuple[int, bool | None]] = (),
) -> int:
    """How far ``checkpoint`` counts (see the module docstring). Pure.

    ``confirmed``: the slot's confirmed position (nothing below it is read again
    anyway); ``streamed``: the highest ``lsn`` header among the relay's own streamed
    records found in Kafka (0: none); ``rows``: the relay's newest row records found
    there, each as (its ``lsn``, whether the outbox table holds its row - None when
    the table keeps no rows). A row the table no longer holds names history the
    server lost: no record at or beyond its LSN is evidence."""
    evidence = streamed
    lost = [lsn for lsn, present in rows if present is False and lsn]
    if lost:
        first_lost = min(lost)
        evidence = max((lsn for lsn, present in rows if present and lsn < first_lost), default=0)
    bound = max(evidence + 1, confirmed) if evidence else confirmed
    return min(checkpoint, bound)


#: The dead-letter topic's tail read for the relay's own dead letters (evidence of a
#: WAL transaction whose records all were dead-lettered): at most this many records a
#: partition (a shared dead-letter topic may hold others' far deeper).
DLQ_EVIDENCE_RECORDS = 1_000


@dataclass(frozen=True)
class Evidence:
    """What Kafka and the table show of the relay's own publishing (:func:`provable`)."""

    #: the highest ``lsn`` of the relay's own streamed records found (0: none)
    streamed: int
    #: its newest row records: (``lsn``, whether the table holds the row; None: unknown)
    rows: tuple[tuple[int, bool | None], ...] = ()


def own_evidence(settings: Settings, owner: Owner, last: LastRecord | None) -> Evidence:
    """The evidence of the relay's own records: ``last`` (the session's tail read of its
    topics, :mod:`cdc.lineage`), its own dead letters in the dead-letter topic's tail,
    and whether the outbox table still holds the rows of its newest row records."""
    streamed = last.streamed_lsn if last is not None else 0
    bounded = settings.model_copy(
        update={"gap_tail_records": 100, "gap_tail_max_records": DLQ_EVIDENCE_RECORDS}
    )
    try:
        dead = read_tails(bounded, owner, [settings.dlq_topic]).last
    except (TailTooDeepError, KafkaException) as exc:  # (no evidence from it: safe)
        log.debug("reading the dead-letter topic's tail: %s", exc)
        dead = None
    if dead is not None:
        streamed = max(streamed, dead.streamed_lsn)
    refs = [r for r in (last.newest_rows if last is not None else ()) if r.commit_lsn]
    if not refs:
        return Evidence(streamed)
    if not settings.outbox_keeps_rows:
        return Evidence(streamed, tuple((r.commit_lsn, None) for r in refs))
    with pg_connect(settings.pg_dsn.get_secret_value(), Use.QUERY) as conn:
        held = {
            str(row[0])
            for row in conn.execute(
                sql.SQL("SELECT id::text FROM {} WHERE id = ANY(%s::uuid[])").format(
                    table_identifier(settings.outbox_table)
                ),
                ([r.id for r in refs],),
            ).fetchall()
        }
    return Evidence(streamed, tuple((r.commit_lsn, r.id in held) for r in refs))


def _exists(settings: Settings, topic: str) -> bool:
    admin = AdminClient(_client_config(settings, "checkpoint-admin"))
    try:
        return topic in admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics
    except KafkaException as exc:
        raise KafkaUnavailableError(f"checkpoint topic {topic}: {exc}") from exc


def _consumer(settings: Settings, isolation: str) -> Consumer:
    return Consumer(
        {
            **_client_config(settings, "checkpoint"),
            "group.id": f"outbox-cdc-checkpoint-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": isolation,
        }
    )


def _read_newest(
    settings: Settings, topic: str, keys: Sequence[str], timeout_s: float
) -> tuple[dict[str, _Newest], int]:
    """The newest committed record of each of ``keys`` in ``topic`` (those found) up to
    the last stable offset as it is now (never waiting for a transaction to end), and
    how many records lay past that offset (open transactions)."""
    where = TopicPartition(topic, 0)
    wanted = {key.encode(): key for key in keys}
    consumer = _consumer(settings, "read_committed")
    try:
        # (a read_committed consumer's ListOffsets answers the last stable offset)
        low, stable = consumer.get_watermark_offsets(where, timeout=ADMIN_TIMEOUT_S, cached=False)
        high = _high_watermark(settings, where)
        # (our predecessor's transaction, aborted by our init_transactions, may still
        # hold the last stable offset for a moment: waited for, bounded - never longer)
        deadline = time.monotonic() + PREDECESSOR_ABORT_WAIT_S
        while stable < high and time.monotonic() < deadline:
            time.sleep(0.1)
            stable = consumer.get_watermark_offsets(where, timeout=ADMIN_TIMEOUT_S, cached=False)[1]
        found: dict[str, _Newest] = {}
        if stable > max(low, 0):
            consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
            found = _read_to(consumer, topic, wanted, stable, timeout_s)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"reading checkpoint topic {topic}: {exc}") from exc
    finally:
        consumer.close()
    if high > stable:  # (past it: committed or not - provable() bounds what counts)
        found.update(_read_past(settings, topic, wanted, max(stable, low), high, timeout_s))
    return found, max(high - stable, 0)


def _high_watermark(settings: Settings, where: TopicPartition) -> int:
    """The partition's end, open transactions' records included."""
    consumer = _consumer(settings, "read_uncommitted")
    try:
        return int(consumer.get_watermark_offsets(where, timeout=ADMIN_TIMEOUT_S, cached=False)[1])
    finally:
        consumer.close()


def _read_past(
    settings: Settings, topic: str, keys: dict[bytes, str], start: int, end: int, timeout_s: float
) -> dict[str, _Newest]:
    """The newest record of each of ``keys`` in [``start``, ``end``) read uncommitted:
    behind another producer's open transaction, this relay's later checkpoints - and
    those of its own aborted transactions, which no read can tell apart: each counts
    only as far as the relay's own *committed* records show it (:func:`provable`)."""
    consumer = _consumer(settings, "read_uncommitted")
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        return _read_to(consumer, topic, keys, end, timeout_s)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"reading checkpoint topic {topic}: {exc}") from exc
    finally:
        consumer.close()


def _read_to(
    consumer: Consumer, topic: str, keys: dict[bytes, str], end: int, timeout_s: float
) -> dict[str, _Newest]:
    """The newest record of each of ``keys`` before offset ``end`` (its headers read
    once, defensively): read until the consumer's position reaches ``end`` (commit
    markers included) or the partition's end."""
    deadline = time.monotonic() + timeout_s
    reader = RecordReader()
    found: dict[str, _Newest] = {}
    where = [TopicPartition(topic, 0)]
    while time.monotonic() < deadline:
        for msg in consumer.consume(1000, min(1.0, max(deadline - time.monotonic(), 0.01))):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return found
                if err.fatal() or not err.retriable():
                    raise KafkaUnavailableError(f"reading checkpoint topic {topic}: {err}")
                continue
            offset = msg.offset() or 0
            if offset >= end:  # (committed after the read began: not needed)
                return found
            name = keys.get(msg.key() or b"")
            if name is None:
                continue
            record = reader.read(msg)  # (the only read of its headers)
            found[name] = _Newest(
                offset=offset,
                origin=record.header(c.HEADER_ORIGIN) if record is not None else None,
                value=msg.value() or b"",
                unreadable=record is None,
            )
        position = consumer.position(where)[0].offset
        if position >= end:
            return found
    raise KafkaUnavailableError(
        f"checkpoint topic {topic}: not read to offset {end} within {timeout_s:g}s"
    )


def checkpoint_headers(origin: str) -> list[tuple[str, bytes]]:
    """The headers of a checkpoint record."""
    return [(c.HEADER_ORIGIN, origin.encode())]
