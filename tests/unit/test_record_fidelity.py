"""Both routing paths publish the payload's bytes as PostgreSQL sent them (issue 24).

Generated ``jsonb`` texts (numbers beyond a double, 30-digit decimals, unicode,
escapes, nesting) go through the relay's fast path (a UTF-8 database, a known
topic) and through the full decoder (the same rows as a non-UTF-8 database):
the records are identical and the value is the text, byte for byte. Logical
messages pass their ``payload`` member's exact text.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.jsontext import MAX_DEPTH, TOO_DEEP, object_error, object_members, too_deep
from cdc.relay.stream.loop import Relay
from cdc.router import DeadLetterCode, RouteError, TxContext, route_message
from tests.unit.test_relay_routing import (  # the same recording producer and wire format
    new_session,
    producer_of,
    relation,
    row,
    run_tx,
    shape,
)

# Every test runs with the pure-Python Insert parser and the compiled one.
pytestmark = pytest.mark.usefixtures("insert_parser")

_texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=8)
_numbers = st.sampled_from(
    [
        "18446744073709551616",
        "-9223372036854775809",
        "1.5e400",
        "0.10000000000000000000001",
        "123456789012345678901234567890.123",
        "-0",
        "1E-400",
    ]
)
_scalars = st.builds(json.dumps, _texts) | _numbers | st.sampled_from(["true", "null", "{}", "[]"])
_values = st.recursive(
    _scalars,
    lambda ch: (
        st.lists(ch, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")
        | st.dictionaries(_texts, ch, max_size=3).map(
            lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
        )
    ),
    max_leaves=10,
)
objects = st.dictionaries(_texts, _values, max_size=4).map(
    lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
)


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(objects, min_size=1, max_size=5))
def test_fast_path_and_full_decoder_publish_the_same_exact_bytes(payloads: list[str]) -> None:
    records = []
    for utf8, payload_oid in ((True, JSONB), (True, TEXT), (False, JSONB)):
        relay = _new_relay()
        relay.decoder.utf8 = utf8
        sess = new_session()
        relay.decoder.on_change(sess, _relation(payload_oid))
        rows = [
            row(event_id=f"{n:08d}-0000-4000-8000-000000000000", payload=p.encode())
            for n, p in enumerate([payloads[0], *payloads])
        ]  # the first warms the topic
        run_tx(relay, sess, rows, final_lsn=0x9000)
        records.append([shape(p) for p in producer_of(relay).produced])
        assert not sess.pending_dlq
    assert records[0] == records[1] == records[2]
    assert [r[1] for r in records[0][1:]] == [p.encode() for p in payloads]


@given(payload=objects)
def test_a_message_passes_its_payload_member_exactly(payload: str) -> None:
    doc = (
        '{"id": "e", "aggregatetype": "user", "aggregateid": "k", "type": "T",'
        f' "payload": {payload} }}'
    )
    record = route_message(doc.encode(), TxContext("0/1", 0), topic_prefix="p.")
    assert record.value == payload.encode()
    assert object_error(payload.encode()) is None
    assert object_members(payload).keys() == json.loads(payload).keys()


JSONB, TEXT = 3802, 25


def _relation(payload_oid: int) -> bytes:
    """The outbox Relation of test_relay_routing with the payload column's type changed."""
    text = relation()
    at = text.index(b"payload\0") + len(b"payload\0")
    return text[:at] + struct.pack(">I", payload_oid) + text[at + 4 :]


def _new_relay() -> Relay:
    from cdc.relay.stream import loop as relay_mod
    from cdc.settings import Settings
    from tests.unit.test_relay_routing import FakeTopics, RecordingProducer

    original = relay_mod.TopicManager
    relay_mod.TopicManager = lambda **_: FakeTopics()  # type: ignore[assignment,misc]
    try:
        r = Relay(
            Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9"),
            serve_http=False,
        )
    finally:
        relay_mod.TopicManager = original  # type: ignore[misc]
    r._producer = RecordingProducer()  # type: ignore[assignment]
    return r


def test_dead_letters_carry_the_rows_id_key_and_topic() -> None:
    """Issue 24 item 5: routing errors keep the identity the row holds."""
    relay = _new_relay()
    relay.decoder.utf8 = False
    sess = new_session()
    relay.decoder.on_change(sess, _relation(JSONB))
    bad_key = row(aggregateid=b"k\xff")
    not_object = row(event_id="10000000-0000-4000-8000-000000000000", payload=b"[1]")
    run_tx(relay, sess, [bad_key, not_object], final_lsn=0xA000)
    first, second = sess.pending_dlq
    assert (first.key, first.topic, first.event_id) == (
        b"k\xff",
        "outbox.event.user",
        "0b9f6f2e-5d1c-4f7e-9a53-0e6f3c1d2a10",
    )
    assert (second.key, second.topic, second.event_id) == (
        b"u-1",
        "outbox.event.user",
        "10000000-0000-4000-8000-000000000000",
    )
    relay.dead_letters.drain(sess)
    dlq = producer_of(relay).produced[-1]
    assert dlq.key == b"u-1" and dict(dlq.headers)["dlq.original.topic"] == b"outbox.event.user"


# ---- one depth rule for every path (issue 34 item 9) --------------------------------


def _nested(depth: int, leaf: str = "1") -> str:
    """A JSON object whose arrays and objects nest exactly ``depth`` levels deep."""
    return '{"a": ' * (depth - 1) + '{"n": ' + leaf + "}" + "}" * (depth - 1)


@pytest.mark.parametrize(
    ("text", "deep"),
    [
        (_nested(MAX_DEPTH).encode(), False),
        (_nested(MAX_DEPTH + 1).encode(), True),
        (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, False),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), True),
        (b"[" * (MAX_DEPTH + 1), True),  # not JSON, still too deep
        (b'{"s": "' + b"[" * 2 * MAX_DEPTH + b'"}', False),  # brackets in a string
        (b'{"s": "\\"' + b"{" * 2 * MAX_DEPTH + b'"}', False),  # after an escaped quote
        (b'{"s": "\\\\", "t": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", True),
        (b"[" * 300 + b"]" * 300 + b"{" * 300 + b"}" * 300, False),  # many, never deep
    ],
    ids=[
        "at-limit",
        "one-over",
        "arrays-at-limit",
        "arrays-one-over",
        "unclosed",
        "in-string",
        "escaped-quote",
        "escaped-backslash",
        "siblings",
    ],
)
def test_too_deep_counts_brackets_outside_strings(text: bytes, deep: bool) -> None:
    assert too_deep(text) is deep
    assert (object_error(text) == TOO_DEEP) is deep


def _deep_rows() -> list[list[bytes | None]]:
    """A shallow row (it warms the topic: the rest take the fast path), one at the
    limit (with a number beyond a double: the exact check), one over it."""
    return [
        row(event_id=f"{n:08d}-0000-4000-8000-000000000000", payload=p.encode())
        for n, p in enumerate(['{"x": 1}', _nested(MAX_DEPTH, "1.5e400"), _nested(MAX_DEPTH + 1)])
    ]


@pytest.mark.parametrize(
    ("utf8", "payload_oid"),
    [(True, JSONB), (True, TEXT), (False, JSONB)],
    ids=["fast-path-jsonb", "fast-path-text", "full-decoder"],
)
def test_one_depth_rule_for_the_fast_path_the_full_decoder_and_the_recovery(
    utf8: bool, payload_oid: int
) -> None:
    """Issue 34 item 9: a payload at MAX_DEPTH is published on every path, one level
    deeper it is dead-lettered on every path, with the same reason."""
    from cdc.repair.republish import outbox_record
    from cdc.settings import Settings

    rows = _deep_rows()
    relay = _new_relay()
    relay.decoder.utf8 = utf8
    sess = new_session()
    relay.decoder.on_change(sess, _relation(payload_oid))
    run_tx(relay, sess, rows, final_lsn=0xB000)
    published = [p.value for p in producer_of(relay).produced]
    assert published == [rows[0][4], rows[1][4]]
    (dead,) = sess.pending_dlq
    assert (dead.code, dead.reason) == (DeadLetterCode.NOT_JSON, f"payload is {TOO_DEEP}")
    assert dead.event_id == rows[2][0].decode()  # type: ignore[union-attr]

    # the recovery routes the table's rows with the full decoder: the same outcome
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9")
    tx = TxContext("0/B000", 0)
    recovered = [
        outbox_record(
            (*(None if v is None else v.decode() for v in r[:5]), None), tx, settings, b"1"
        )
        for r in rows
    ]
    assert [r.topic for r in recovered] == [
        "outbox.event.user",
        "outbox.event.user",
        settings.dlq_topic,
    ]
    assert [r.value for r in recovered[:2]] == published
    assert dict(recovered[2].headers)["dlq.reason"] == f"payload is {TOO_DEEP}".encode()


def test_a_logical_messages_payload_follows_the_same_depth_rule() -> None:
    def message(payload: str) -> bytes:
        return (
            '{"id": "e", "aggregatetype": "user", "aggregateid": "k", "type": "T",'
            f' "payload": {payload}}}'
        ).encode()

    at_limit = _nested(MAX_DEPTH)
    record = route_message(message(at_limit), TxContext("0/1", 0), topic_prefix="p.")
    assert record.value == at_limit.encode()
    with pytest.raises(RouteError) as raised:
        route_message(message(_nested(MAX_DEPTH + 1)), TxContext("0/1", 0), topic_prefix="p.")
    assert raised.value.code is DeadLetterCode.NOT_JSON
    assert raised.value.reason == f"outbox message's payload is {TOO_DEEP}"
    assert (raised.value.event_id, raised.value.key, raised.value.topic) == ("e", b"k", "p.user")
