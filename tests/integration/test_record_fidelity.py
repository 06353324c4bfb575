"""Record fidelity against real PostgreSQL and Kafka (issue 24).

What reaches Kafka is the row - the payload's bytes included - or a dead letter
naming the row and the reason:

* generated rows (integers beyond 64 bits, 30-digit decimals, exponents beyond a
  double, unicode, escapes, nesting, empty objects; unicode keys and aggregate
  types) written through ``write_event``, raw SQL and ``emit_event`` arrive with
  value = ``payload::text`` (or the emitted payload's jsonb text) and headers =
  the row's columns; the first row of each topic takes the full decoder, the
  rest the fast path (both paths for every row: tests/unit/test_record_fidelity.py);
* an outbox table in another schema is published (publication created or
  pre-existing), or refused at start with one line naming both;
* renamed, dropped and retyped required columns under a running relay are
  dead-lettered ``missing_field`` with the row's identity, never published wrong;
* ``write_event`` and ``emit_event`` refuse the same payloads.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from cdc.errors import DatabaseSetupError
from cdc.jsontext import MAX_DEPTH, TOO_DEEP
from cdc.outbox import OutboxEvent, OutboxPayloadError, emit_event, write_event
from cdc.wal.stream import ensure_publication
from tests.harness import (
    RelayConfig,
    drop_slot,
    headers_of,
    read_topics,
    start_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# ---- strategies: JSON text with number tokens no double can hold -------------

_texts = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
    max_size=12,
)
_big_ints = st.integers(min_value=2**64, max_value=10**40) | st.integers(
    min_value=-(10**40), max_value=-(2**63) - 1
)
_decimals = st.builds(
    lambda digits, point, sign: f"{sign}{digits[:point]}.{digits[point:]}",
    st.from_regex(r"[1-9][0-9]{29}", fullmatch=True),
    st.integers(min_value=1, max_value=29),
    st.sampled_from(["", "-"]),
)
_exponents = st.builds(
    lambda m, e: f"{m}e{e}",
    st.sampled_from(["1.5", "-2", "9.999"]),
    st.sampled_from(["400", "-400", "+309"]),
)
_tokens = (
    st.builds(json.dumps, _texts)
    | st.builds(str, _big_ints)
    | _decimals
    | _exponents
    | st.sampled_from(["true", "false", "null", "0", "-0.0", '"\\u00e9\\n\\"\\\\"'])
)


def _nest(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    arrays = st.lists(children, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")
    objects = st.dictionaries(_texts, children, max_size=3).map(
        lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"
    )
    return arrays | objects


_json_values = st.recursive(_tokens, _nest, max_leaves=12)
#: a JSON object's text, as an application might write it by hand
json_objects = st.dictionaries(_texts, _json_values, max_size=5).map(
    lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
)
#: Python payloads write_event/emit_event take (integers of any size are exact)
_py_scalars = (
    _texts | st.integers(min_value=-(10**30), max_value=10**30) | st.booleans() | st.none()
)
py_payloads = st.dictionaries(
    _texts,
    st.recursive(
        _py_scalars,
        lambda ch: st.lists(ch, max_size=3) | st.dictionaries(_texts, ch, max_size=3),
        max_leaves=10,
    ),
    max_size=5,
)
keys = st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cc"]), min_size=1, max_size=10)


@st.composite
def outbox_rows(draw: st.DrawFn, fresh_type: str) -> dict[str, Any]:
    channel = draw(st.sampled_from(["write_event", "sql", "emit_event"]))
    kind = draw(st.sampled_from(["known", "fresh", "unicode"]))
    aggtype = {"known": "order", "fresh": fresh_type, "unicode": "zählung"}[kind]
    return {
        "channel": channel,
        "id": uuid.uuid4(),  # (not drawn: unique across examples and shrinks)
        "aggregatetype": aggtype,
        "aggregateid": draw(keys),
        "type": draw(st.sampled_from(["Created", "Geändert", "x.y-z"])),
        "trace": draw(st.sampled_from([None, TRACE])),
        "payload": draw(json_objects if channel == "sql" else py_payloads),
    }


# ---- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fid(
    db_dsn: str, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayConfig]:
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=uuid.uuid4().hex[:10],
        extra={"CDC_MESSAGES": "on"},  # (emit_event is one of the channels)
    )
    proc, _ = start_relay(cfg, tmp_path_factory.mktemp("fidelity"))
    try:
        yield cfg
    finally:
        proc.close()
        drop_slot(db_dsn, cfg.slot)


def _write(conn: psycopg.Connection[Any], row: dict[str, Any]) -> str:
    """Write the row through its channel; the payload text Kafka must carry."""
    event = OutboxEvent(
        event_id=row["id"],
        aggregate_type=row["aggregatetype"],
        aggregate_id=row["aggregateid"],
        event_type=row["type"],
        payload=row["payload"] if row["channel"] != "sql" else {},
        traceparent=row["trace"],
    )
    with conn.transaction():
        if row["channel"] == "emit_event":
            emit_event(conn, event)
            got = conn.execute("SELECT (%s::jsonb -> 'payload')::text", (event.message_json(),))
        else:
            if row["channel"] == "write_event":
                write_event(conn, event)
            else:
                conn.execute(
                    "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload,"
                    " tracingspancontext) VALUES (%s, %s, %s, %s, %s::jsonb, %s)",
                    (
                        event.event_id,
                        *[row[k] for k in ("aggregatetype", "aggregateid", "type")],
                        row["payload"],
                        row["trace"],
                    ),
                )
            got = conn.execute("SELECT payload::text FROM outbox WHERE id = %s", (row["id"],))
        stored = got.fetchone()
    assert stored is not None
    return str(stored[0])


# ---- the property test ---------------------------------------------------------------


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=False,
)
@given(data=st.data())
def test_every_generated_row_reaches_kafka_as_written(
    fid: RelayConfig, data: st.DataObject
) -> None:
    fresh = f"f{uuid.uuid4().hex[:8]}"  # a new topic per example: its first row is fully decoded
    rows = data.draw(st.lists(outbox_rows(fresh), min_size=3, max_size=10), label="rows")
    with psycopg.connect(fid.db_dsn) as conn:
        expected = {str(row["id"]): (row, _write(conn, row)) for row in rows}
    topics = sorted(
        {fid.topic_prefix + r["aggregatetype"] for r in rows if r["aggregatetype"].isascii()}
    )
    dead = [r for r in rows if not r["aggregatetype"].isascii()]
    # (the dead-letter topic and a reused aggregate type's topic hold earlier examples'
    # records too: they count toward ``expect``, so a read can end before this example's
    # last record arrived - read again until every id is in, within a bound)
    deadline = time.monotonic() + 60
    while True:
        got = read_topics(fid.kafka, [*topics, fid.dlq_topic], expect=len(rows), idle_s=0.5)
        by_id = {headers_of(m)["id"].decode(): m for m in got if headers_of(m).get("id")}
        if set(expected) <= set(by_id) or time.monotonic() > deadline:
            break
    for event_id, (row, payload_text) in expected.items():
        msg = by_id.get(event_id)
        assert msg is not None, f"{event_id} never reached Kafka ({row['channel']})"
        h = headers_of(msg)
        assert msg.value() == payload_text.encode(), row["channel"]
        assert msg.key() == row["aggregateid"].encode()
        if row in dead:
            assert msg.topic() == fid.dlq_topic
            assert b"invalid topic name" in h["dlq.reason"]
            continue
        assert msg.topic() == fid.topic_prefix + row["aggregatetype"]
        assert h["type"] == row["type"].encode()
        assert h["aggregatetype"] == row["aggregatetype"].encode()
        assert h.get("traceparent") == (row["trace"].encode() if row["trace"] else None)


def test_the_edge_numbers_of_the_issue_arrive_unchanged(fid: RelayConfig) -> None:
    payloads = [
        '{"n": 18446744073709551616}',
        '{"n": 12345678901234567890123, "m": -9223372036854775809}',
        '{"d": 0.10000000000000000000001, "e": 1.5e400, "z": {}, "deep": '
        + "[" * 200
        + "]" * 200
        + "}",
    ]
    ids = [uuid.uuid4() for _ in payloads]
    with psycopg.connect(fid.db_dsn) as conn, conn.transaction():
        for event_id, payload in zip(ids, payloads, strict=True):
            conn.execute(
                "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)"
                " VALUES (%s, 'order', 'k', 'T', %s)",
                (event_id, payload),
            )
        stored = {
            str(i): t
            for i, t in conn.execute(
                "SELECT id, payload::text FROM outbox WHERE id = ANY(%s)", (ids,)
            )
        }
    msgs = read_topics(fid.kafka, [fid.topic_prefix + "order"], expect=3, idle_s=0.5)
    values = {headers_of(m)["id"].decode(): m.value() for m in msgs}
    for text_id in map(str, ids):
        assert values[text_id] == stored[text_id].encode()
    assert b"18446744073709551616" in values[str(ids[0])]


def _nested(depth: int) -> str:
    return '{"a": ' * (depth - 1) + '{"n": 1}' + "}" * (depth - 1)


def test_one_depth_rule_on_the_fast_path_the_full_decoder_and_logical_messages(
    fid: RelayConfig,
) -> None:
    """Issue 34 item 9: a jsonb payload nested one level more than MAX_DEPTH is
    dead-lettered with the same reason whether the fast path or the full decoder
    reads it (the first row of a topic not yet known takes the full decoder, and a
    dead-lettered row leaves the topic unknown); at MAX_DEPTH it is published; a
    logical message's payload follows the same rule."""
    first, second = (f"d{uuid.uuid4().hex[:8]}" for _ in range(2))
    deep, at_limit = _nested(MAX_DEPTH + 1), _nested(MAX_DEPTH)
    rows = [  # (aggregatetype, payload, path)
        (first, deep, "full decoder"),
        (first, '{"x": 1}', "full decoder"),
        (second, '{"x": 2}', "full decoder"),
        (second, at_limit, "fast path"),
        (second, deep, "fast path"),
    ]
    ids = [uuid.uuid4() for _ in rows]
    message_ids = [uuid.uuid4() for _ in range(2)]
    with psycopg.connect(fid.db_dsn) as conn, conn.transaction():
        for event_id, (aggtype, payload, _) in zip(ids, rows, strict=True):
            conn.execute(
                "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)"
                " VALUES (%s, %s, 'k', 'T', %s)",
                (event_id, aggtype, payload),
            )
        for event_id, payload in zip(message_ids, (at_limit, deep), strict=True):
            doc = (
                f'{{"id": "{event_id}", "aggregatetype": "{second}", "aggregateid": "k",'
                f' "type": "T", "payload": {payload}}}'
            )
            conn.execute("SELECT pg_logical_emit_message(true, 'outbox', %s)", (doc,))
    want = {str(i) for i in (*ids, *message_ids)}
    topics = [fid.topic_prefix + first, fid.topic_prefix + second, fid.dlq_topic]
    by_id: dict[str, Any] = {}

    def all_arrived() -> bool:
        got = read_topics(fid.kafka, topics, expect=len(want), idle_s=0.5)
        by_id.update({headers_of(m)["id"].decode(): m for m in got if headers_of(m).get("id")})
        return want <= by_id.keys()

    wait_until(all_arrived, 120, "every row, published or dead-lettered")
    reason = f"payload is {TOO_DEEP}".encode()
    for event_id, (aggtype, payload, path) in zip(ids, rows, strict=True):
        msg = by_id[str(event_id)]
        assert msg.value() == payload.encode(), path
        if payload is deep:
            assert msg.topic() == fid.dlq_topic, path
            assert headers_of(msg)["dlq.reason"] == reason, path
        else:
            assert msg.topic() == fid.topic_prefix + aggtype, path
    published, dead = (by_id[str(i)] for i in message_ids)
    assert (published.topic(), published.value()) == (fid.topic_prefix + second, at_limit.encode())
    assert dead.topic() == fid.dlq_topic
    assert headers_of(dead)["dlq.reason"] == b"outbox message's " + reason


# ---- write_event and emit_event refuse the same payloads ----------------------------


@pytest.mark.parametrize(
    "payload",
    [{"x": float("nan")}, {"x": float("inf")}, [1, 2], "text", {"x": "\ud800"}],
    ids=["nan", "infinity", "list", "string", "lone-surrogate"],
)
def test_write_event_and_emit_event_refuse_the_same_payloads(db_dsn: str, payload: Any) -> None:
    event = OutboxEvent(aggregate_type="t", aggregate_id="k", event_type="T", payload=payload)
    with psycopg.connect(db_dsn) as conn:
        for write in (write_event, emit_event):
            with pytest.raises(OutboxPayloadError), conn.transaction():
                write(conn, event)
        count = conn.execute("SELECT count(*) FROM outbox WHERE id = %s", (event.event_id,))
        assert count.fetchone() == (0,)


def test_write_event_and_emit_event_refuse_nul_alike(db_dsn: str) -> None:
    """jsonb cannot hold \\u0000: PostgreSQL refuses it in both forms, nothing is written."""
    event = OutboxEvent(aggregate_type="t", aggregate_id="k", event_type="T", payload={"x": "a\0"})
    with psycopg.connect(db_dsn) as conn:
        for write in (write_event, emit_event):
            with pytest.raises(psycopg.errors.UntranslatableCharacter), conn.transaction():
                write(conn, event)


# ---- the outbox table in another schema ---------------------------------------------


@pytest.fixture
def app_schema(db_dsn: str, unique: str) -> Iterator[str]:
    schema = f"app_{unique}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("CREATE TABLE {} (LIKE public.outbox INCLUDING ALL)").format(
                sql.Identifier(schema, "outbox")
            )
        )
    yield schema
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.parametrize("publication", ["created", "pre-existing"])
def test_an_outbox_table_in_another_schema_is_published(
    db_dsn: str,
    kafka_bootstrap: str,
    unique: str,
    app_schema: str,
    tmp_path: Path,
    publication: str,
) -> None:
    pub = f"pub_{unique}"
    table = f"{app_schema}.outbox"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        if publication == "pre-existing":
            conn.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                    sql.Identifier(pub), sql.Identifier(app_schema, "outbox")
                )
            )
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_OUTBOX_TABLE": table, "CDC_PUBLICATION": pub},
    )
    proc, _ = start_relay(cfg, tmp_path)
    try:
        event = OutboxEvent(
            aggregate_type="order", aggregate_id="k1", event_type="T", payload={"a": 1}
        )
        with psycopg.connect(db_dsn) as conn, conn.transaction():
            write_event(conn, event, table=table)
        msgs = read_topics(kafka_bootstrap, [cfg.topic_prefix + "order"], expect=1, idle_s=0.5)
        assert [headers_of(m)["id"] for m in msgs] == [str(event.event_id).encode()]
        with psycopg.connect(db_dsn) as conn:
            published = conn.execute(
                "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (pub,)
            ).fetchall()
        assert published == [(app_schema, "outbox")]
    finally:
        proc.close()
        drop_slot(db_dsn, cfg.slot)
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(pub)))


@pytest.mark.parametrize(
    ("create", "says"),
    [
        ("CREATE PUBLICATION {pub} FOR TABLE public.outbox", "does not publish the outbox table"),
        ("CREATE PUBLICATION {pub} FOR TABLE {tbl} WHERE (aggregatetype <> 'x')", "row filter"),
        ("CREATE PUBLICATION {pub} FOR TABLE {tbl} (id, aggregatetype, payload)", "column list"),
        ("CREATE PUBLICATION {pub} FOR TABLE {tbl} WITH (publish = 'update')", "inserts"),
    ],
    ids=["other-table", "row-filter", "column-list", "no-inserts"],
)
def test_a_publication_that_does_not_cover_the_outbox_is_refused_naming_both(
    db_dsn: str, unique: str, app_schema: str, create: str, says: str
) -> None:
    pub = f"pub_{unique}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(create.format(pub=pub, tbl=f"{app_schema}.outbox"))
        try:
            with pytest.raises(DatabaseSetupError) as info:
                ensure_publication(conn, pub, f"{app_schema}.outbox")
        finally:
            conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(pub)))
    message = str(info.value)
    assert says in message and pub in message and f"{app_schema}.outbox" in message
    assert "\n" not in message


def test_the_relay_refuses_at_start_with_one_line(
    db_dsn: str, kafka_bootstrap: str, unique: str, app_schema: str, tmp_path: Path
) -> None:
    """The migration's outbox_pub publishes public.outbox, not app.outbox: a silent skip before."""
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_OUTBOX_TABLE": f"{app_schema}.outbox", "CDC_PUBLICATION": "outbox_pub"},
    )
    proc, _ = start_relay(cfg, tmp_path, wait_ready=False)
    try:
        wait_until(lambda: not proc.alive(), 60, "the relay to refuse")
        assert proc.terminate() != 0
        line = (
            f"error: publication outbox_pub does not publish the outbox table {app_schema}.outbox"
        )
        assert line in proc.log_tail(), proc.log_tail()
    finally:
        proc.close()
        drop_slot(db_dsn, cfg.slot)


def test_a_missing_required_column_is_refused_at_start(db_dsn: str, app_schema: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {} DROP COLUMN type").format(sql.Identifier(app_schema, "outbox"))
        )
        with pytest.raises(DatabaseSetupError, match="has no column type"):
            ensure_publication(conn, f"pub_{app_schema}", f"{app_schema}.outbox")


# ---- required columns changed under a running relay ---------------------------------


@pytest.mark.parametrize(
    ("alter", "reason"),
    [
        ("ALTER TABLE {t} RENAME COLUMN type TO event_type", "has no column type"),
        ("ALTER TABLE {t} DROP COLUMN aggregateid", "has no column aggregateid"),
        ("ALTER TABLE {t} ALTER COLUMN type TYPE int USING 0", "column type has type oid 23"),
    ],
    ids=["renamed", "dropped", "retyped"],
)
def test_a_required_column_changed_under_a_running_relay_is_dead_lettered(
    db_dsn: str,
    kafka_bootstrap: str,
    unique: str,
    app_schema: str,
    tmp_path: Path,
    alter: str,
    reason: str,
) -> None:
    table = f"{app_schema}.outbox"
    cfg = RelayConfig(
        db_dsn=db_dsn,
        kafka=kafka_bootstrap,
        unique=unique,
        extra={"CDC_OUTBOX_TABLE": table, "CDC_PUBLICATION": f"pub_{unique}"},
    )
    proc, _ = start_relay(cfg, tmp_path)
    ident = f'"{app_schema}".outbox'
    try:
        before, after = uuid.uuid4(), uuid.uuid4()
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            with conn.transaction():
                write_event(
                    conn,
                    OutboxEvent(
                        event_id=before,
                        aggregate_type="order",
                        aggregate_id="k0",
                        event_type="T",
                        payload={"a": 1},
                        traceparent=TRACE,
                    ),
                    table=table,
                )
            conn.execute(alter.format(t=ident))
            columns = [
                r[0]
                for r in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
                    " AND NOT attisdropped",
                    (ident,),
                )
            ]
            values = {
                "id": after,
                "aggregatetype": "order",
                "aggregateid": "k1",
                "type": 0,
                "event_type": "T",
                "payload": '{"b": 2}',
                "tracingspancontext": TRACE,
            }
            cols = [c for c in columns if c in values]
            conn.execute(
                sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    sql.Identifier(app_schema, "outbox"),
                    sql.SQL(", ").join(map(sql.Identifier, cols)),
                    sql.SQL(", ").join(sql.Placeholder() * len(cols)),
                ),
                [values[c] for c in cols],
            )
        msgs = read_topics(
            kafka_bootstrap, [cfg.topic_prefix + "order", cfg.dlq_topic], expect=2, idle_s=1.0
        )
        by_id = {headers_of(m)["id"].decode(): m for m in msgs}
        assert set(by_id) == {str(before), str(after)}
        assert by_id[str(before)].topic() == cfg.topic_prefix + "order"
        dead = by_id[str(after)]
        h = headers_of(dead)
        assert dead.topic() == cfg.dlq_topic, "never published with another column's value"
        assert reason.encode() in h["dlq.reason"]
        if "aggregateid" in cols:
            assert dead.key() == b"k1"
            assert h["dlq.original.topic"] == (cfg.topic_prefix + "order").encode()
        assert proc.alive(), proc.log_tail()
        assert reason in proc.log_tail(200)
    finally:
        proc.close()
        drop_slot(db_dsn, cfg.slot)
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(f"pub_{unique}"))
            )
