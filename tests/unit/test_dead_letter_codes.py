"""Dead-letter reasons: a fixed set of codes for metrics, the full text for the record.

Every refusal of the router carries its :class:`DeadLetterCode`; Kafka's record
errors map to one; the minimal dead letter (for one Kafka refused for its
size) cuts every field.
"""

from __future__ import annotations

import orjson
import pytest
from confluent_kafka import KafkaError

from cdc.kafka.producer import RECORD_ERRORS, is_record_error, record_error_code
from cdc.router import (
    DeadLetterCode,
    RouteError,
    TxContext,
    dead_letter,
    route_fields,
    route_message,
)

TX = TxContext("0/16B3748", 1_795_000_000_123_456)
ID = "0b9f6f2e-5d1c-4f7e-9a53-0e6f3c1d2a10"


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ((ID, "user", "", "T", "{}", None), DeadLetterCode.MISSING_FIELD),
        ((ID, "user", "k", "T", "{not json", None), DeadLetterCode.NOT_JSON),
        ((ID, "user events", "k", "T", "{}", None), DeadLetterCode.INVALID_TOPIC),
    ],
    ids=["missing", "not-json", "topic"],
)
def test_every_row_refusal_carries_its_code(
    fields: tuple[str, str, str, str, str, None], code: DeadLetterCode
) -> None:
    with pytest.raises(RouteError) as info:
        route_fields(*fields, TX, "outbox.event.")
    assert info.value.code is code


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"not json", DeadLetterCode.NOT_JSON),
        (b"[1, 2]", DeadLetterCode.NOT_JSON),
        (b'{"id": "x", "aggregatetype": "user"}', DeadLetterCode.MISSING_FIELD),
        (
            orjson.dumps(
                {"id": ID, "aggregatetype": "a/b", "aggregateid": "k", "type": "T", "payload": {}}
            ),
            DeadLetterCode.INVALID_TOPIC,
        ),
    ],
    ids=["not-json", "not-object", "missing", "topic"],
)
def test_every_message_refusal_carries_its_code(content: bytes, code: DeadLetterCode) -> None:
    with pytest.raises(RouteError) as info:
        route_message(content, TX, topic_prefix="outbox.event.")
    assert info.value.code is code


def test_kafka_record_errors_map_to_codes_and_cluster_errors_are_not_record_errors() -> None:
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    assert record_error_code(too_large) is DeadLetterCode.TOO_LARGE
    assert record_error_code(KafkaError(KafkaError.INVALID_RECORD)) is DeadLetterCode.INVALID_RECORD
    assert set(RECORD_ERRORS.values()) <= set(DeadLetterCode)
    assert not is_record_error(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    assert not is_record_error(KafkaError(KafkaError._FATAL))


def test_the_minimal_dead_letter_cuts_the_key_every_header_and_the_value() -> None:
    record = dead_letter(
        reason="aggregatetype " + "t" * 5_000,
        event_id=ID,
        original_topic="outbox.event." + "t" * 5_000,
        key=b"k" * 5_000,
        raw=b"v" * 5_000,
        headers=[("id", ID.encode()), ("traceparent", b"x" * 5_000)],
        tx=TX,
        dlq_topic="outbox.dlq",
        max_value_bytes=0,
        max_field_bytes=100,
    )
    assert record.key == b"k" * 100
    assert all(len(v) <= 100 for _, v in record.headers)
    assert dict(record.headers)["id"] == ID.encode()
    note = orjson.loads(record.value)
    assert note["truncated"] is True
    assert (note["original_size"], note["original_key_size"]) == (5_000, 5_000)
    assert len(note["prefix"]) == 1024


def test_the_full_dead_letter_keeps_the_reason_whole() -> None:
    reason = "aggregatetype " + "t" * 5_000
    record = dead_letter(
        reason=reason,
        event_id=ID,
        original_topic="",
        key=b"",
        raw=b"{}",
        headers=[],
        tx=TX,
        dlq_topic="outbox.dlq",
        max_value_bytes=512 * 1024,
    )
    assert dict(record.headers)["dlq.reason"] == reason.encode()
    assert record.value == b"{}"
