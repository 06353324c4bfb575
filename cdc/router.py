"""Router: an outbox event (table row or logical message) -> one Kafka record.

Pure. The record is the contract any topic consumer relies on (DESIGN.md):

* topic  = ``topic_prefix + aggregatetype``
* key    = ``aggregateid`` (UTF-8), so one aggregate's events share a partition
* value  = the payload JSON, compact UTF-8
* headers ``id`` (event uuid = idempotency key), ``type``, ``aggregatetype``,
  ``lsn`` (commit LSN), ``commit_ts`` (ISO-8601 UTC), ``origin`` (the relay's
  session: system identifier / timeline / slot), ``traceparent`` when present
* timestamp = the transaction's commit time in milliseconds

An event that cannot become a record (a missing field, a payload that is not
JSON, a topic name Kafka would refuse) raises :class:`RouteError` with the
reason and one :class:`DeadLetterCode`; the relay dead-letters it, it is never
dropped. The code (a fixed set) labels metrics; the reason text, which may
quote the event's own values, goes only into the dead-letter record and the log.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson

from cdc import constants as c
from cdc.errors import CdcError

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
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.event_id = event_id
        self.raw = raw


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x on the hot path
class KafkaRecord:
    """One record ready for ``Producer.produce``."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int
    event_id: str


class TxContext:
    """What the enclosing transaction contributes to each of its records.

    Built once per transaction; its header values are encoded once, not per record.
    """

    __slots__ = ("commit_lsn", "commit_ts_us", "headers", "lsn_header", "timestamp_ms", "ts_header")

    def __init__(
        self, commit_lsn: str, commit_ts_us: int, origin: tuple[str, bytes] | None = None
    ) -> None:
        """``origin``: the session's prebuilt ``origin`` header (cdc.lineage), or None."""
        self.commit_lsn = commit_lsn
        self.commit_ts_us = commit_ts_us
        self.timestamp_ms = commit_ts_us // 1000
        self.lsn_header = (c.HEADER_LSN, commit_lsn.encode())
        self.ts_header = (c.HEADER_COMMIT_TS, self.commit_ts_iso.encode())
        self.headers: tuple[tuple[str, bytes], ...] = (
            (self.lsn_header, self.ts_header)
            if origin is None
            else (self.lsn_header, self.ts_header, origin)
        )

    @property
    def commit_ts_iso(self) -> str:
        return iso_utc_us(self.commit_ts_us)


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
    """Route the outbox columns of :data:`ROUTED_COLUMNS` (text values, None for NULL)."""
    if not (event_id and aggregate_type and aggregate_id and event_type and payload):
        fields = (event_id, aggregate_type, aggregate_id, event_type, payload)
        missing = [name for name, v in zip(_REQUIRED, fields, strict=True) if not v]
        raise RouteError(
            f"outbox row lacks {', '.join(missing)}",
            code=DeadLetterCode.MISSING_FIELD,
            event_id=event_id or "",
            raw=orjson.dumps(dict(zip(ROUTED_COLUMNS, (*fields, traceparent), strict=True))),
        )
    try:
        value = orjson.dumps(orjson.loads(payload))
    except orjson.JSONDecodeError as exc:
        raise RouteError(
            f"payload is not JSON: {exc}",
            code=DeadLetterCode.NOT_JSON,
            event_id=event_id,
            raw=payload.encode(),
        ) from exc
    return _record(
        event_id, aggregate_type, aggregate_id, event_type, value, traceparent, tx, topic_prefix
    )


def _invalid_topic(aggregate_type: str, topic: str, event_id: str, raw: bytes) -> RouteError:
    return RouteError(
        f"aggregatetype {aggregate_type!r} makes an invalid topic name {topic!r}",
        code=DeadLetterCode.INVALID_TOPIC,
        event_id=event_id,
        raw=raw,
    )


def route_message(content: bytes, tx: TxContext, *, topic_prefix: str) -> KafkaRecord:
    """Route a ``pg_logical_emit_message(true, 'outbox', json)`` event."""
    try:
        doc = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise RouteError(
            f"outbox message is not JSON: {exc}", code=DeadLetterCode.NOT_JSON, raw=content
        ) from exc
    if not isinstance(doc, dict):
        raise RouteError(
            "outbox message is not a JSON object", code=DeadLetterCode.NOT_JSON, raw=content
        )
    event_id = str(doc.get("id") or "")
    missing = [name for name in _REQUIRED if doc.get(name) in (None, "")]
    if missing:
        raise RouteError(
            f"outbox message lacks {', '.join(missing)}",
            code=DeadLetterCode.MISSING_FIELD,
            event_id=event_id,
            raw=content,
        )
    trace = doc.get("tracingspancontext")
    return _record(
        event_id=event_id,
        aggregate_type=str(doc["aggregatetype"]),
        aggregate_id=str(doc["aggregateid"]),
        event_type=str(doc["type"]),
        value=orjson.dumps(doc["payload"]),
        traceparent=str(trace) if trace else None,
        tx=tx,
        topic_prefix=topic_prefix,
    )


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
        raise _invalid_topic(aggregate_type, topic, event_id, value)
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
    if not any(k == c.HEADER_ID for k, _ in kept):
        kept.append((c.HEADER_ID, event_id.encode()))
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
