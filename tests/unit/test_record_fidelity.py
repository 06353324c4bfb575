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

from cdc.jsontext import object_error, object_members
from cdc.relay.loop import Relay
from cdc.router import TxContext, route_message
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
        relay._utf8 = utf8
        sess = new_session()
        relay._on_change(sess, _relation(payload_oid))
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
    from cdc.relay import loop as relay_mod
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
    relay._utf8 = False
    sess = new_session()
    relay._on_change(sess, _relation(JSONB))
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
    relay._drain_dlq(sess)
    dlq = producer_of(relay).produced[-1]
    assert dlq.key == b"u-1" and dict(dlq.headers)["dlq.original.topic"] == b"outbox.event.user"
