"""Router: an outbox event (table row or logical message) -> one Kafka record.

Pure. The record is the contract any topic consumer relies on (DESIGN.md):

* topic  = ``topic_prefix + aggregatetype``
* key    = ``aggregateid`` (UTF-8), so one aggregate's events share a partition
* value  = the payload's JSON text exactly as PostgreSQL hands it over (for a
  ``jsonb`` column ``SELECT payload::text``; for a logical message the exact
  text of its ``payload`` member), checked to be one JSON object nested at
  most :data:`cdc.jsontext.MAX_DEPTH` levels deep (deeper: dead-lettered on
  every path alike), never re-encoded: no number, string or space of it is changed
* headers ``id`` (event uuid = idempotency key), ``type``, ``aggregatetype``,
  ``lsn`` (commit LSN), ``commit_ts`` (ISO-8601 UTC), ``origin`` (the relay's
  session: system identifier / timeline / slot), ``traceparent`` when present,
  ``form: message`` on a record made from a logical message (none on a row's)
* timestamp = the transaction's commit time in milliseconds

An event that cannot become a record (a missing field, a payload that is not a
JSON object, a topic name Kafka would refuse) raises :class:`RouteError` with
the reason, one :class:`DeadLetterCode` and the event's id, key and topic as far
as they can be read; the relay dead-letters it, it is never dropped. The code
(a fixed set) labels metrics; the reason text, which may quote the event's own
values, goes only into the dead-letter record and the log.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

import orjson

from cdc import constants as c
from cdc.errors import CdcError
from cdc.jsontext import MAX_DEPTH, TOO_DEEP, object_error, object_members, too_deep

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_REQUIRED = ("id", "aggregatetype", "aggregateid", "type", "payload")
#: Topic names already checked against _TOPIC_RE (bounded: names come from config
#: prefix + aggregate types, a small set in practice; capped anyway).
_VALID_TOPICS: set[str] = set()
_VALID_TOPICS_MAX = 10_000


def _valid_topic(topic: str) -> bool:
    if not _TOPIC_RE.match(topic):
        return False
    if len(_VALID_TOPICS) < _VALID_TOPICS_MAX:
        _VALID_TOPICS.add(topic)
    return True


class DeadLetterCode(enum.StrEnum):
    """Why an event went to the dead-letter topic, as a fixed set (a metric label)."""

    MISSING_FIELD = "missing_field"  # a required outbox column or message field is empty
    NOT_JSON = "not_json"  # the payload (or the logical message) is not JSON / not an object
    INVALID_TOPIC = "invalid_topic"  # the aggregatetype makes a topic name Kafka refuses
    NOT_UTF8 = "not_utf8"  # a text value is not valid UTF-8
    NON_TRANSACTIONAL = "non_transactional"  # an outbox message emitted outside a transaction
    TOO_LARGE = "too_large"  # Kafka: the record (or its batch) is larger than allowed
    INVALID_RECORD = "invalid_record"  # Kafka: the record is invalid (format, CRC, timestamp)
    OTHER = "other"  # anything not listed above


class RouteError(CdcError):
    """The event cannot be turned into a Kafka record; ``reason`` says why, ``code`` sorts it."""

    def __init__(
        self,
        reason: str,
        *,
        code: DeadLetterCode = DeadLetterCode.OTHER,
        event_id: str = "",
        raw: bytes = b"",
        key: bytes = b"",
        topic: str = "",
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.event_id = event_id
        self.raw = raw
        #: the event's key and topic when they can be read (else empty): the
        #: dead letter carries them, so triage and redelivery find the event
        self.key = key
        self.topic = topic


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class KafkaRecord:
    """One record ready for ``Producer.produce``."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int
    event_id: str


_HEADER_LSN, _HEADER_COMMIT_TS = c.HEADER_LSN, c.HEADER_COMMIT_TS


class TxContext:
    """What the enclosing transaction contributes to each of its records.

    Built once per transaction, at its first record; its header values are
    encoded once, not per record. :meth:`of_texts` builds it from header texts
    already made (the relay's Begin, read in place: :func:`cdc.wal.pgoutput.begin_context`).
    """

    __slots__ = ("commit_ts_us", "headers", "timestamp_ms")

    def __init__(
        self, commit_lsn: str, commit_ts_us: int, origin: tuple[str, bytes] | None = None
    ) -> None:
        """``origin``: the session's prebuilt ``origin`` header (cdc.lineage), or None."""
        self.commit_ts_us = commit_ts_us
        self.timestamp_ms = commit_ts_us // 1000
        lsn = (c.HEADER_LSN, commit_lsn.encode())
        ts = (c.HEADER_COMMIT_TS, iso_utc_us(commit_ts_us).encode())
        self.headers: tuple[tuple[str, bytes], ...] = (
            (lsn, ts) if origin is None else (lsn, ts, origin)
        )

    @classmethod
    def of_texts(
        cls,
        lsn_text: bytes,
        commit_ts_us: int,
        ts_text: bytes,
        origin: tuple[str, bytes] | None = None,
    ) -> TxContext:
        """The context whose ``lsn`` and ``commit_ts`` headers read ``lsn_text`` and
        ``ts_text`` (as :meth:`__init__` would write them); no __init__ call."""
        tx = cls.__new__(cls)
        tx.commit_ts_us = commit_ts_us
        tx.timestamp_ms = commit_ts_us // 1000
        lsn, ts = (_HEADER_LSN, lsn_text), (_HEADER_COMMIT_TS, ts_text)
        tx.headers = (lsn, ts) if origin is None else (lsn, ts, origin)
        return tx

    @property
    def lsn_header(self) -> tuple[str, bytes]:
        return self.headers[0]

    @property
    def ts_header(self) -> tuple[str, bytes]:
        return self.headers[1]

    @property
    def commit_lsn(self) -> str:
        return self.headers[0][1].decode()

    @property
    def commit_ts_iso(self) -> str:
        return self.headers[1][1].decode()


#: "YYYY-MM-DDTHH:MM:SS" per Unix second: many commits share a second, and
#: datetime formatting per record was a tenth of the relay's CPU.
_ISO_SECONDS: dict[int, str] = {}
_ISO_SECONDS_MAX = 4096


def iso_utc_us(ts_us: int) -> str:
    """Unix microseconds as ISO-8601 UTC with microseconds: ``2026-11-29T10:00:00.123456Z``."""
    secs, micros = divmod(ts_us, 1_000_000)
    head = _ISO_SECONDS.get(secs)
    if head is None:
        if len(_ISO_SECONDS) >= _ISO_SECONDS_MAX:
            _ISO_SECONDS.clear()
        head = _ISO_SECONDS[secs] = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{head}.{micros:06d}Z"


#: The outbox columns the router reads, in the order :func:`route_fields` takes them.
ROUTED_COLUMNS = ("id", "aggregatetype", "aggregateid", "type", "payload", "tracingspancontext")


#: Type oids whose text form each routed column may have (built-in types; a
#: user type - a domain, an enum - has an oid from 16384 on and is accepted: the
#: relay checks its base type in the catalog at start).
_TEXT_OIDS = frozenset({25, 1043, 1042, 19})  # text, varchar, bpchar, name
JSONB_OID = 3802
_USABLE_TYPES: dict[str, frozenset[int]] = {
    "id": _TEXT_OIDS | {2950},  # uuid
    "aggregatetype": _TEXT_OIDS,
    "aggregateid": _TEXT_OIDS | {2950, 20, 21, 23},  # uuid, int8, int2, int4
    "type": _TEXT_OIDS,
    "payload": _TEXT_OIDS | {JSONB_OID, 114},  # jsonb, json
    "tracingspancontext": _TEXT_OIDS,
}
_FIRST_USER_OID = 16384


class OutboxLayout(NamedTuple):
    """Where the routed columns sit in an outbox relation's rows (all present, usable)."""

    ncols: int
    id: int
    aggregatetype: int
    aggregateid: int
    type: int
    payload: int
    trace: int | None  # the optional tracingspancontext; None when the table has none
    #: the payload column is ``jsonb``: its text (jsonb_out) is valid JSON by
    #: construction, so "one JSON object" is its first byte being ``{``
    payload_jsonb: bool


@dataclass(frozen=True, slots=True)
class BrokenOutbox:
    """An outbox relation lacking a required column or holding one of an unusable type.

    Its rows are dead-lettered (``missing_field``) with ``problem`` as reason,
    never routed: no other column can stand in for the missing one.
    """

    problem: str
    #: positions of the routed columns the relation does have (to name the row)
    positions: dict[str, int]


def outbox_layout(table: str, columns: list[tuple[str, int]]) -> OutboxLayout | BrokenOutbox:
    """The layout of an outbox relation from its ``(column name, type oid)`` list."""
    positions = {name: i for i, (name, _) in enumerate(columns)}
    problems: list[str] = []
    for name in ROUTED_COLUMNS:
        at = positions.get(name)
        if at is None:
            if name != "tracingspancontext":
                problems.append(f"has no column {name} (renamed or dropped?)")
            continue
        oid = columns[at][1]
        if oid < _FIRST_USER_OID and oid not in _USABLE_TYPES[name]:
            problems.append(f"column {name} has type oid {oid}, not a text/uuid/json type")
    if problems:
        return BrokenOutbox(f"outbox table {table} {'; '.join(problems)}", positions)
    return OutboxLayout(
        ncols=len(columns),
        id=positions["id"],
        aggregatetype=positions["aggregatetype"],
        aggregateid=positions["aggregateid"],
        type=positions["type"],
        payload=positions["payload"],
        trace=positions.get("tracingspancontext"),
        payload_jsonb=columns[positions["payload"]][1] == JSONB_OID,
    )


def route_row(row: dict[str, str | None], tx: TxContext, *, topic_prefix: str) -> KafkaRecord:
    """Route an outbox table row (column name -> text value)."""
    get = row.get
    return route_fields(
        get("id"),
        get("aggregatetype"),
        get("aggregateid"),
        get("type"),
        get("payload"),
        get("tracingspancontext"),
        tx,
        topic_prefix,
    )


def event_identity(
    aggregate_type: str | None, aggregate_id: str | None, prefix: str
) -> tuple[bytes, str]:
    """The key and (valid) topic of an event, as far as they can be read."""
    key = aggregate_id.encode() if aggregate_id else b""
    topic = prefix + aggregate_type if aggregate_type else ""
    if topic and topic not in _VALID_TOPICS and not _valid_topic(topic):
        topic = ""
    return key, topic


def route_fields(
    event_id: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    event_type: str | None,
    payload: str | None,
    traceparent: str | None,
    tx: TxContext,
    topic_prefix: str,
) -> KafkaRecord:
    """Route the outbox columns of :data:`ROUTED_COLUMNS` (text values, None for NULL).

    The value is ``payload`` itself (its UTF-8 bytes), once checked to be one
    JSON object: never parsed into floats and written back.
    """
    if not (event_id and aggregate_type and aggregate_id and event_type and payload):
        fields = (event_id, aggregate_type, aggregate_id, event_type, payload)
        missing = [name for name, v in zip(_REQUIRED, fields, strict=True) if not v]
        key, topic = event_identity(aggregate_type, aggregate_id, topic_prefix)
        raise RouteError(
            f"outbox row lacks {', '.join(missing)}",
            code=DeadLetterCode.MISSING_FIELD,
            event_id=event_id or "",
            raw=orjson.dumps(dict(zip(ROUTED_COLUMNS, (*fields, traceparent), strict=True))),
            key=key,
            topic=topic,
        )
    value = payload.encode()
    problem = object_error(value)
    if problem is not None:
        key, topic = event_identity(aggregate_type, aggregate_id, topic_prefix)
        raise RouteError(
            f"payload is {problem}",
            code=DeadLetterCode.NOT_JSON,
            event_id=event_id,
            raw=value,
            key=key,
            topic=topic,
        )
    return _record(
        event_id, aggregate_type, aggregate_id, event_type, value, traceparent, tx, topic_prefix
    )


def _invalid_topic(
    aggregate_type: str, topic: str, event_id: str, raw: bytes, key: bytes
) -> RouteError:
    return RouteError(
        f"aggregatetype {aggregate_type!r} makes an invalid topic name {topic!r}",
        code=DeadLetterCode.INVALID_TOPIC,
        event_id=event_id,
        raw=raw,
        key=key,
    )


def _member_text(member: tuple[object, str] | None) -> str | None:
    """A message member as text: a JSON string's value, any other value's exact JSON text."""
    if member is None or member[0] is None:
        return None
    value, text = member
    return value if isinstance(value, str) else text


def route_message(content: bytes, tx: TxContext, *, topic_prefix: str) -> KafkaRecord:
    """Route a ``pg_logical_emit_message(true, 'outbox', json)`` event.

    The value is the exact text of the message's ``payload`` member, which
    must be a JSON object.
    """
    try:
        members = object_members(content.decode())
    except UnicodeDecodeError as exc:
        raise RouteError(
            f"outbox message is not valid UTF-8: {exc}", code=DeadLetterCode.NOT_UTF8, raw=content
        ) from exc
    except ValueError as exc:
        raise RouteError(
            f"outbox message is {exc}", code=DeadLetterCode.NOT_JSON, raw=content
        ) from exc
    fields = [_member_text(members.get(name)) for name in _REQUIRED]
    event_id, aggregate_type, aggregate_id, event_type, _ = fields
    key, topic = event_identity(aggregate_type, aggregate_id, topic_prefix)
    missing = [name for name, v in zip(_REQUIRED, fields, strict=True) if not v]
    if missing:
        raise RouteError(
            f"outbox message lacks {', '.join(missing)}",
            code=DeadLetterCode.MISSING_FIELD,
            event_id=event_id or "",
            raw=content,
            key=key,
            topic=topic,
        )
    assert event_id and aggregate_type and aggregate_id and event_type
    if not isinstance(members["payload"][0], dict):
        raise RouteError(
            "outbox message's payload is not a JSON object",
            code=DeadLetterCode.NOT_JSON,
            event_id=event_id,
            raw=content,
            key=key,
            topic=topic,
        )
    value = members["payload"][1].encode()
    if len(value) > MAX_DEPTH and too_deep(value):  # (the rule of a table row's payload)
        raise RouteError(
            f"outbox message's payload is {TOO_DEEP}",
            code=DeadLetterCode.NOT_JSON,
            event_id=event_id,
            raw=content,
            key=key,
            topic=topic,
        )
    record = _record(
        event_id=event_id,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        value=value,
        traceparent=_member_text(members.get("tracingspancontext")),
        tx=tx,
        topic_prefix=topic_prefix,
    )
    record.headers.append((c.HEADER_FORM, c.FORM_MESSAGE))  # (cdc.lineage: not in the table)
    return record


def _record(
    event_id: str,
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    value: bytes,
    traceparent: str | None,
    tx: TxContext,
    topic_prefix: str,
) -> KafkaRecord:
    topic = topic_prefix + aggregate_type
    if topic not in _VALID_TOPICS and not _valid_topic(topic):
        raise _invalid_topic(aggregate_type, topic, event_id, value, aggregate_id.encode())
    headers = [
        (c.HEADER_ID, event_id.encode()),
        (c.HEADER_TYPE, event_type.encode()),
        (c.HEADER_AGGREGATE_TYPE, aggregate_type.encode()),
        *tx.headers,
    ]
    if traceparent:
        headers.append((c.HEADER_TRACEPARENT, traceparent.encode()))
    return KafkaRecord(topic, aggregate_id.encode(), value, headers, tx.timestamp_ms, event_id)


def dead_letter(
    *,
    reason: str,
    event_id: str,
    original_topic: str,
    key: bytes,
    raw: bytes,
    headers: list[tuple[str, bytes]],
    tx: TxContext,
    dlq_topic: str,
    max_value_bytes: int,
    max_field_bytes: int | None = None,
) -> KafkaRecord:
    """The dead-letter record of an event: reason and origin in headers.

    Its headers: the record's own (when it had any), the event ``id``, the
    transaction's lineage (commit LSN, commit time, ``origin``) when the record
    did not carry it already - its ``origin`` alone when the transaction has no
    commit LSN (a row republished from the table) - ``dlq.reason`` and ``dlq.original.topic`` (empty
    when no valid topic could be made).

    The value is the original bytes when they fit under ``max_value_bytes``,
    else a JSON note with the original size and a prefix (the full row is still
    in the outbox table until pruned, found by the ``id`` header).

    ``max_field_bytes`` makes the minimal form, for a dead letter Kafka refused
    for its own size: the key and every header value cut to that many bytes, the
    value always the note (which then also gives the original key size).
    """
    if len(raw) <= max_value_bytes:
        value = raw
    else:
        note: dict[str, object] = {
            "truncated": True,
            "original_size": len(raw),
            "prefix": raw[:1024].decode("utf-8", "replace"),
        }
        if max_field_bytes is not None:
            note["original_key_size"] = len(key)
        value = orjson.dumps(note)
    kept = [(k, v) for k, v in headers if k not in (c.HEADER_DLQ_REASON, c.HEADER_DLQ_TOPIC)]
    names = {k for k, _ in kept}
    if c.HEADER_ID not in names:
        kept.append((c.HEADER_ID, event_id.encode()))
    if c.HEADER_LSN not in names and tx.commit_lsn:  # lineage: the transaction it came from
        kept += tx.headers
    elif c.HEADER_ORIGIN not in names and len(tx.headers) > 2:  # (a republished row's: no LSN)
        kept.append(tx.headers[2])  # its origin all the same (cdc.evidence)
    kept += [(c.HEADER_DLQ_REASON, reason.encode()), (c.HEADER_DLQ_TOPIC, original_topic.encode())]
    if max_field_bytes is not None:
        key = key[:max_field_bytes]
        kept = [(k, v[:max_field_bytes]) for k, v in kept]
    return KafkaRecord(
        topic=dlq_topic,
        key=key,
        value=value,
        headers=kept,
        timestamp_ms=tx.timestamp_ms,
        event_id=event_id,
    )
