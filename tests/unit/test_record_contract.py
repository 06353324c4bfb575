"""docs/record-contract.md says what the router writes: these tests hold the page to the code."""

from __future__ import annotations

import re
from pathlib import Path

from cdc.router import TxContext, dead_letter, route_fields, route_message

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "record-contract.md"
TX = TxContext("16/B374D848", 1_796_036_361_123_456, ("origin", b"7301/1/outbox_slot"))
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _section(title: str) -> str:
    text = CONTRACT.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _first_column(section: str) -> list[str]:
    """The backticked names in the first column of the section's table rows."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", row.split("|")[1])[0] for row in rows]


def test_the_header_table_lists_every_header_the_router_writes_in_its_order() -> None:
    record = route_fields("e1", "user", "k1", "UserRegistered", '{"a": 1}', TRACE, TX, "p.")
    # a row's headers, then `form`: written only on a record made from a logical message
    assert [name for name, _ in record.headers] + ["form"] == _first_column(_section("Headers"))
    assert "form" not in dict(record.headers)


def test_header_values_are_plain_utf8_in_the_documented_formats() -> None:
    record = route_fields("e1", "user", "k1", "UserRegistered", '{"a": 1}', TRACE, TX, "p.")
    headers = dict(record.headers)
    assert headers["lsn"] == b"16/B374D848"
    assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", headers["commit_ts"])
    assert headers["traceparent"] == TRACE.encode()
    without = route_fields("e1", "user", "k1", "UserRegistered", '{"a": 1}', "", TX, "p.")
    assert "traceparent" not in dict(without.headers)


def test_value_key_timestamp_and_topic_are_as_documented() -> None:
    stored = '{"b": [1, 2], "a": 1.50, "é": "\\u00e9", "n": 18446744073709551616}'
    record = route_fields("e1", "order", "clé ", "T", stored, None, TX, "outbox.event.")
    assert record.topic == "outbox.event.order"
    assert record.key == "clé ".encode(), "the key as stored: no trimming, no quoting"
    assert record.value == stored.encode(), "the stored text, byte for byte (## Value)"
    assert record.timestamp_ms == TX.commit_ts_us // 1000, "commit time in ms"
    value = _section("Value")
    assert "byte for byte" in value and "`18446744073709551616`" in value
    assert "table.expand.json.payload=false" in value


def test_the_table_less_form_carries_the_payload_member_as_value() -> None:
    doc = '{"id":"e2","aggregatetype":"user","aggregateid":"k","type":"T","payload":{"x": 1.50}}'
    record = route_message(doc.encode(), TX, topic_prefix="outbox.event.")
    assert (record.topic, record.key, record.value) == ("outbox.event.user", b"k", b'{"x": 1.50}')
    assert "exact text of the message's `payload`" in _section("Value")


def test_the_dead_letter_headers_are_the_ones_the_page_names() -> None:
    record = dead_letter(
        reason="payload is not JSON",
        event_id="e3",
        original_topic="",
        key=b"",
        raw=b"not json",
        headers=[],
        tx=TX,
        dlq_topic="outbox.dlq",
        max_value_bytes=512 * 1024,
    )
    section = _section("Dead letters")
    for name, _ in record.headers:
        assert f"`{name}`" in section
    assert record.timestamp_ms == TX.timestamp_ms


def test_no_number_is_changed_and_the_page_says_so() -> None:
    """The deviation the page used to list is gone: numbers pass as stored."""
    for number in ("123456789012345678901234567890", "1.5e400", "0.10000000000000000000001"):
        stored = f'{{"n": {number}}}'
        record = route_fields("e4", "t", "k", "T", stored, None, TX, "p.")
        assert record.value == stored.encode()
    assert "None for the payload" in _section("Known deviations")


def test_the_debezium_settings_on_the_page_are_the_pass_through_ones() -> None:
    section = _section("Side by side with Debezium's outbox event router")
    block = section[section.index("```properties") :]
    block = block[: block.index("```\n", 5)]
    assert "value.converter=org.apache.kafka.connect.storage.StringConverter" in block
    assert "expand.json.payload=true" not in block
