"""The relay's reading of pgoutput changes: the fast path from Insert bytes to a Kafka record.

Guarantees: the fast path yields the very record :func:`cdc.router.route_fields`
would, for the common case only (an outbox row of text values, all required
columns present, a JSON object payload, a known topic, a UTF-8 database); any
other row is decoded fully and routed or dead-lettered with the precise reason.
The payload's bytes are published as PostgreSQL sent them (never re-encoded).
Columns are found by name after every Relation message: an outbox relation
lacking a required column (renamed, dropped) or holding one of an unusable type
is reported once per Relation and its rows are dead-lettered (``missing_field``)
with that reason; no other column ever stands in for a missing one.
Outbox updates, deletes and truncates are counted and logged once a session,
never published; a non-transactional outbox message is dead-lettered. A
payload nested deeper than :data:`cdc.jsontext.MAX_DEPTH` is dead-lettered on
every path with the same reason (:func:`cdc.jsontext.too_deep`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import KafkaException

from cdc import constants as c
from cdc import jsontext
from cdc.constants import PG_EPOCH_OFFSET_US
from cdc.errors import (
    DecodeError,
)
from cdc.gaps import FORM_MESSAGE
from cdc.kafka.producer import (
    TopicManager,
)
from cdc.relay.gaps.ledger import SlotLedger
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.state import PoisonIds, RefusedStep, SendStep, Session
from cdc.router import (
    BrokenOutbox,
    DeadLetterCode,
    KafkaRecord,
    OutboxLayout,
    RouteError,
    TxContext,
    event_identity,
    outbox_layout,
    route_fields,
    route_message,
)
from cdc.settings import Settings
from cdc.wal import pgoutput as pgo
from cdc.wal.replproto import Keepalive, lsn_to_str, parse_copy_data, xlog_payload

if TYPE_CHECKING:
    from cdc.relay.stream.mode import DeliveryMode

log = logging.getLogger("cdc.relay")


_TAG_INSERT, _TAG_BEGIN, _TAG_COMMIT = ord("I"), ord("B"), ord("C")


_TAG_RELATION, _TAG_MESSAGE = ord("R"), ord("M")


_IGNORED_CHANGES = {ord("U"): "update", ord("D"): "delete", ord("T"): "truncate"}


#: CopyData messages handled per loop turn before the producer is polled again.
READ_BATCH = 2_000


#: A read turn's wait for WAL while records are in flight: their delivery reports are
#: served between waits, so an ack (and the confirmation behind it) is not held back.
ACK_WAIT_S = 0.005


_XLOG_PAYLOAD_AT = 25  # 'w', wal_start, wal_end, send_time


#: Bound of the aggregatetype -> topic cache of the fast path.
TOPIC_CACHE_MAX = 10_000


_loads, _JSONDecodeError = orjson.loads, orjson.JSONDecodeError


_MAX_DEPTH, _too_deep = jsontext.MAX_DEPTH, jsontext.too_deep


_H_ID, _H_TYPE, _H_AGGTYPE = c.HEADER_ID, c.HEADER_TYPE, c.HEADER_AGGREGATE_TYPE


_H_TRACEPARENT = c.HEADER_TRACEPARENT


_BEGIN_LEN, _begin_fields = pgo.BEGIN_LEN, pgo.begin_fields


_COMMIT_LEN, _commit_end_lsn = pgo.COMMIT_LEN, pgo.commit_end_lsn


_END_LSN_AT = pgo.COMMIT_END_LSN_AT


_UNKNOWN: Any = object()


def _not_object(doc: bytes) -> bool:
    """Whether orjson does not read ``doc`` as a JSON object (the exact check follows)."""
    try:
        return _loads(doc).__class__ is not dict
    except _JSONDecodeError:
        return True


def _malformed(payload: bytes | memoryview) -> DecodeError:
    """The error :func:`pgo.decode` names for a message the fast path found malformed."""
    try:
        pgo.decode(payload)
    except DecodeError as exc:
        return exc
    return DecodeError(f"malformed pgoutput message ({len(payload)} bytes)")


def _begin_slowly(data: bytes | memoryview, at: int) -> tuple[int, int, bytes, bytes]:
    """What :func:`pgo.begin_context` declined: a malformed Begin raises; a commit
    time it does not format (outside the years 1000-9999) is formatted here."""
    if len(data) - at != _BEGIN_LEN:
        raise _malformed(data[at:])
    final_lsn, commit_ts, _xid = _begin_fields(data, at + 1)
    ts_us = commit_ts + PG_EPOCH_OFFSET_US
    tx = TxContext(lsn_to_str(final_lsn), ts_us)
    return final_lsn, ts_us, tx.lsn_header[1], tx.ts_header[1]


def _tx_context(sess: Session) -> TxContext:
    """The open transaction's context, made at its first record from its Begin."""
    begin = sess.begin
    assert begin is not None
    tx = sess.tx = TxContext.of_texts(begin[2], begin[1], begin[3], sess.origin)
    return tx


def _decode(value: object) -> str | None:
    """A text value of an Insert tuple as str (None for NULL)."""
    if value is None:
        return None
    if value.__class__ is bytes:
        return value.decode()
    raise DecodeError("outbox row has a non-text value: the full row is not in the stream")


def _broken_row(broken: BrokenOutbox, values: pgo.TupleData, prefix: str) -> RouteError:
    """The dead-letter reason of a row of a broken outbox relation, naming the row."""
    row = {name: _decode(values[at]) for name, at in broken.positions.items()}
    key, topic = event_identity(row.get("aggregatetype"), row.get("aggregateid"), prefix)
    return RouteError(
        broken.problem,
        code=DeadLetterCode.MISSING_FIELD,
        event_id=row.get("id") or "",
        raw=orjson.dumps(row),
        key=key,
        topic=topic,
    )


def read_begin(sess: Session, data: bytes | memoryview, at: int) -> None:
    """Begin (at ``data[at]``), read in place with its header texts: one per
    transaction, no message object; its :class:`TxContext` waits for its first record.
    (At-least-once's ``wal_begins``: :mod:`cdc.relay.stream.mode`.)"""
    begin = pgo.begin_context(data, at)
    if begin is None:  # malformed (raises), or a commit time beyond the years 1000-9999
        begin = _begin_slowly(data, at)
    sess.tx_id = begin[0]
    sess.begin = begin
    sess.tracker.open(begin[0])


def read_commit(sess: Session, data: bytes | memoryview, at: int) -> None:
    """Commit (at ``data[at]``), read in place: the transaction's records are all
    produced. (At-least-once's ``wal_ends``: :mod:`cdc.relay.stream.mode`.)"""
    if len(data) - at != _COMMIT_LEN:
        raise _malformed(data[at:])
    if sess.tx_id is None:
        raise DecodeError("pgoutput Commit outside a transaction")
    sess.tracker.close(sess.tx_id, _commit_end_lsn(data, at + _END_LSN_AT)[0])
    sess.tx_id = sess.begin = sess.tx = sess.reports = None


class FastPath:
    """The relay's decoder (a collaborator of :class:`~cdc.relay.stream.loop.Relay`):
    pgoutput messages read, Inserts routed to Kafka records. Where a record goes is
    the delivery mode's (:mod:`cdc.relay.stream.mode`: its ``record`` step, and its
    ``wal_begins``/``wal_ends`` at Begin and Commit); the slow paths hand over to the
    producer (:meth:`Producing.produce`) and the dead letters."""

    def __init__(
        self,
        settings: Settings,
        metrics: RelayMetrics,
        *,
        poison: PoisonIds,
        topics: TopicManager,
        ledger: SlotLedger,
        mode: DeliveryMode,
        produce: Callable[[Session, int, KafkaRecord], None],
        refused: RefusedStep,
        dead_letter_route: Callable[[Session, int, TxContext, RouteError], None],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.poison = poison
        self._topics = topics
        self._ledger = ledger
        table = settings.outbox_table
        #: (schema, name) of the outbox table (the publication's: set at each session)
        self.table: tuple[str, ...] | tuple[None, str] = (
            tuple(table.split(".", 1)) if "." in table else (None, table)
        )
        #: aggregatetype as sent -> its topic, validated and created (fast path)
        self.topic_of: dict[bytes, str] = {}
        #: the database's text is UTF-8, so the fast path may use raw bytes
        self.utf8 = False
        # The delivery mode's steps and the producer's, as instance attributes: one
        # lookup and one call each per message, as a method of this class would cost.
        self._send: SendStep = mode.record
        self.on_begin = mode.wal_begins
        self.on_commit = mode.wal_ends
        self._read_wait_s = mode.read_wait_s
        self._produce = produce
        self._refused = refused
        self._dead_letter_route = dead_letter_route

    def read_batch(self, sess: Session) -> bool:
        """A read turn of the loop: up to :data:`READ_BATCH` messages of the session's
        stream, each decoded and handed over; whether any arrived."""
        stream, tracker = sess.stream, sess.tracker
        get_nowait = stream.get_nowait
        on_change, handle, on_insert = self.on_change, self.handle, self.on_insert
        on_begin, on_commit = self.on_begin, self.on_commit
        limit = self.settings.relay_max_in_flight
        wait_s = ACK_WAIT_S if tracker.in_flight else self._read_wait_s()
        data: memoryview | bytes | None
        for _ in range(READ_BATCH):
            nbytes, data = get_nowait()
            if nbytes <= 0:  # nothing buffered (wait for it), or the stream ended (raises)
                data = stream.read(wait_s)
                if data is None:
                    sess.caught_up = True
                    return wait_s == 0.0
            wait_s = 0.0
            if data[0] == 0x77 and len(data) > _XLOG_PAYLOAD_AT:  # XLogData: the hot path
                # read in place, not copied; Insert, Begin and Commit dispatched here as
                # on_change would (one Python call less per message)
                tag = data[_XLOG_PAYLOAD_AT]
                if tag == 0x49:  # 'I'
                    on_insert(sess, data, _XLOG_PAYLOAD_AT)
                elif tag == 0x42:  # 'B'
                    on_begin(sess, data, _XLOG_PAYLOAD_AT)
                elif tag == 0x43:  # 'C'
                    on_commit(sess, data, _XLOG_PAYLOAD_AT)
                else:
                    on_change(sess, data, _XLOG_PAYLOAD_AT)
            else:
                handle(sess, data)
            if sess.reply_requested or tracker.in_flight >= limit:
                if tracker.in_flight >= limit:  # (Kafka is behind the reading: a backlog)
                    sess.caught_up = False
                return True
        sess.caught_up = False  # (READ_BATCH messages and more there: a backlog)
        return True

    def handle(self, sess: Session, data: memoryview | bytes) -> None:
        """One CopyData message of the replication stream."""
        payload = xlog_payload(data)
        if payload is None:
            msg = parse_copy_data(data)
            if isinstance(msg, Keepalive):
                sess.tracker.observe_wal_end(msg.wal_end)
                if msg.reply_requested:
                    sess.reply_requested = True
            return
        self.on_change(sess, payload)

    def on_change(self, sess: Session, data: bytes | memoryview, at: int = 0) -> None:
        """One pgoutput message: ``data[at:]``, e.g. the payload of an XLogData message
        read where it lies (the loop passes the CopyData message and 25: Insert,
        Begin and Commit are read in place, never copied out first)."""
        if len(data) <= at:
            raise DecodeError("empty pgoutput message")
        tag = data[at]
        if tag == _TAG_INSERT:
            self.on_insert(sess, data, at)
        elif tag == _TAG_BEGIN:
            self.on_begin(sess, data, at)
        elif tag == _TAG_COMMIT:
            self.on_commit(sess, data, at)
        elif tag == _TAG_RELATION:
            rel = pgo.decode(data[at:])
            assert isinstance(rel, pgo.Relation)
            sess.relations.update(rel)
            sess.outbox_oids.pop(rel.oid, None)
            if self._is_outbox(rel):
                self._outbox_index(sess, rel.oid)  # checked at once: reported, not only used
        elif tag == _TAG_MESSAGE:
            self._on_message(sess, pgo.decode(data[at:]))
        elif tag in _IGNORED_CHANGES:
            self._on_ignored(sess, _IGNORED_CHANGES[tag])

    def _on_ignored(self, sess: Session, kind: str) -> None:
        """Outbox updates/deletes/truncates: counted, logged once a session, never published."""
        self.metrics.ignored.labels(kind).inc()
        if kind not in sess.ignored_kinds:
            sess.ignored_kinds.add(kind)
            log.info(
                "publication %s sends outbox %ss: counted, not published",
                self.settings.publication,
                kind,
            )

    def _is_outbox(self, rel: pgo.Relation) -> bool:
        schema, name = self.table
        return rel.name == name and (schema is None or rel.namespace == schema)

    def on_insert(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """An Insert: the fast path routes straight from the message bytes.

        It handles the common case - an outbox row of text values, all
        required columns present, a JSON payload, a known topic, a UTF-8
        database - and yields the very record :func:`route_fields` would. Any
        other row goes to :meth:`_on_insert_slowly`, which decodes it fully
        and dead-letters or raises with the precise reason.
        """
        tx_id = sess.tx_id
        found = pgo.insert_text_values(data, at) if tx_id is not None else None
        if found is None:
            self._on_insert_slowly(sess, data, at)
            return
        oid, found_values = found
        values: list[Any] = found_values  # (bytes | None: checked below, C-level)
        index = sess.outbox_oids.get(oid, _UNKNOWN)
        if index is _UNKNOWN:
            index = self._outbox_index(sess, oid)
        if index is None:
            return
        if index.__class__ is not OutboxLayout or len(values) != index[0] or not self.utf8:
            self._on_insert_slowly(sess, data, at)
            return
        _, i_id, i_aggtype, i_agg, i_type, i_payload, i_trace, jsonb = index
        event_id = values[i_id]
        aggtype = values[i_aggtype]
        topic = self.topic_of.get(aggtype) if aggtype is not None else None
        key, event_type, value = values[i_agg], values[i_type], values[i_payload]
        if topic is None or not (event_id and key and event_type and value):
            self._on_insert_slowly(sess, data, at)
            return
        # One JSON object, checked, never re-encoded: jsonb text is valid JSON by
        # construction (an object starts with "{"); other types are parsed once.
        # Nested too deeply for cdc.jsontext's rule (the full decoder's and the
        # recovery's), it is theirs to dead-letter.
        if ((value[0] != 0x7B) if jsonb else _not_object(value)) or (
            len(value) > _MAX_DEPTH and _too_deep(value)
        ):
            self._on_insert_slowly(sess, data, at)
            return
        assert tx_id is not None
        tx = sess.tx or _tx_context(sess)
        # The headers in the contract's order, as cdc.router builds them.
        headers = [(_H_ID, event_id), (_H_TYPE, event_type), (_H_AGGTYPE, aggtype), *tx.headers]
        if i_trace is not None and (trace := values[i_trace]):
            headers.append((_H_TRACEPARENT, trace))
        if self.poison and event_id in self.poison:  # (C-level checks: the hot path)
            self._produce(
                sess,
                tx_id,
                KafkaRecord(topic, key, value, headers, tx.timestamp_ms, event_id.decode()),
            )
            return
        sess.tracker.add(tx_id)
        # (the step read as an attribute, then called: ``self._send(...)`` would be a
        # method load CPython 3.11 cannot specialize for an instance's own attribute -
        # a generic lookup per record; this is one cached load)
        send = self._send
        try:
            send(sess, tx_id, topic, value, key, headers, tx.timestamp_ms, event_id)
        except KafkaException as exc:
            self._refused(sess, tx_id, exc, topic, key, value, headers, tx.timestamp_ms)

    def _on_insert_slowly(self, sess: Session, data: bytes | memoryview, at: int) -> None:
        """An Insert the fast path declined, whatever the reason: the one way from the
        fast path to the full decoder (:func:`pgo.decode`, then :meth:`_on_insert_decoded`)."""
        self._on_insert_decoded(sess, pgo.decode(data[at:]))

    def _on_insert_decoded(self, sess: Session, ins: Any) -> None:
        """An Insert the fast path did not take: decoded fully, routed or dead-lettered."""
        assert isinstance(ins, pgo.Insert)
        if sess.tx_id is None:
            raise DecodeError("pgoutput Insert outside a transaction")
        oid = ins.relation_oid
        index = sess.outbox_oids.get(oid, _UNKNOWN)
        if index is _UNKNOWN:
            index = self._outbox_index(sess, oid)
        if index is None:
            return
        tx = sess.tx or _tx_context(sess)
        values = ins.new
        if len(values) != len(sess.relations.get(oid).columns):
            raise DecodeError(f"row of relation {oid} does not match its Relation message")
        try:
            if isinstance(index, BrokenOutbox):
                raise _broken_row(index, values, self.settings.topic_prefix)
            assert isinstance(index, OutboxLayout)
            # Insert tuples hold bytes or None (unchanged-TOAST exists only in updates).
            record = route_fields(
                _decode(values[index.id]),
                _decode(values[index.aggregatetype]),
                _decode(values[index.aggregateid]),
                _decode(values[index.type]),
                _decode(values[index.payload]),
                _decode(values[index.trace]) if index.trace is not None else None,
                tx,
                self.settings.topic_prefix,
            )
        except UnicodeDecodeError as exc:
            self._dead_letter_route(sess, sess.tx_id, tx, self._not_utf8(index, values, exc))
            return
        except RouteError as exc:
            self._dead_letter_route(sess, sess.tx_id, tx, exc)
            return
        self._produce(sess, sess.tx_id, record)
        aggtype = values[index.aggregatetype]
        if isinstance(aggtype, bytes) and record.topic in self._topics.known:
            if len(self.topic_of) >= TOPIC_CACHE_MAX:
                self.topic_of.clear()
            self.topic_of[aggtype] = record.topic

    def _not_utf8(
        self, index: OutboxLayout | BrokenOutbox, values: pgo.TupleData, exc: UnicodeDecodeError
    ) -> RouteError:
        """The dead-letter reason of a row that is not UTF-8, with the id, the key's raw
        bytes and the topic as far as they can be read."""
        at = index._asdict() if isinstance(index, OutboxLayout) else index.positions

        def raw(name: str) -> bytes:
            i = at.get(name)
            value = values[i] if isinstance(i, int) else None
            return value if isinstance(value, bytes) else b""

        try:
            topic = event_identity(raw("aggregatetype").decode(), "", self.settings.topic_prefix)[1]
        except UnicodeDecodeError:
            topic = ""
        return RouteError(
            f"outbox row is not valid UTF-8: {exc}",
            code=DeadLetterCode.NOT_UTF8,
            event_id=raw("id").decode(errors="replace"),
            key=raw("aggregateid"),
            topic=topic,
        )

    def _outbox_index(self, sess: Session, oid: int) -> OutboxLayout | BrokenOutbox | None:
        """Where the routed columns sit in relation ``oid``, found by name; None when
        it is not the outbox. Cached until its next Relation message; a broken
        outbox relation (a required column missing or unusable) is logged then."""
        rel = sess.relations.get(oid)
        index: OutboxLayout | BrokenOutbox | None = None
        if self._is_outbox(rel):
            index = outbox_layout(
                f"{rel.namespace or 'pg_catalog'}.{rel.name}",
                [(col.name, col.type_oid) for col in rel.columns],
            )
            if isinstance(index, BrokenOutbox):
                log.error("%s: its rows are dead-lettered (missing_field)", index.problem)
        sess.outbox_oids[oid] = index
        return index

    def _on_message(self, sess: Session, msg: Any) -> None:
        assert isinstance(msg, pgo.Message)
        if msg.prefix != c.OUTBOX_MESSAGE_PREFIX:
            return
        if sess.tx_id is None:
            # A non-transactional outbox message: never atomic with business
            # data, so it is dead-lettered rather than published.
            tx = TxContext(lsn_to_str(msg.lsn), int(time.time() * 1_000_000))
            # msg.lsn is the record's end; a following commit may start there,
            # so the pseudo-transaction's id sits just below it.
            sess.tracker.open(msg.lsn - 1)
            content = bytes(msg.content)
            try:  # the event's identity, as far as it can be read
                record = route_message(content, tx, topic_prefix=self.settings.topic_prefix)
                event_id, key, topic = record.event_id, record.key, record.topic
            except RouteError as exc:
                event_id, key, topic = exc.event_id, exc.key, exc.topic
            self._dead_letter_route(
                sess,
                msg.lsn - 1,
                tx,
                RouteError(
                    "non-transactional outbox message (use pg_logical_emit_message(true, ...))",
                    code=DeadLetterCode.NON_TRANSACTIONAL,
                    raw=content,
                    event_id=event_id,
                    key=key,
                    topic=topic,
                ),
            )
            sess.tracker.close(msg.lsn - 1, msg.lsn)
            return
        tx = sess.tx or _tx_context(sess)
        try:
            record = route_message(bytes(msg.content), tx, topic_prefix=self.settings.topic_prefix)
        except RouteError as exc:
            self._dead_letter_route(sess, sess.tx_id, tx, exc)
            return
        self._ledger.note_form(FORM_MESSAGE)  # (recorded before the first: cdc.relay.gaps.gap)
        self._produce(sess, sess.tx_id, record)
