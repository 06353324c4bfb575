"""Exactly-once mode's pure parts: names, fencing errors, the capped tracker, the settings."""

from __future__ import annotations

import re
import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc.errors import CdcError, ConfigError
from cdc.lineage import Origin, Owner
from cdc.records import Skip
from cdc.relay.checkpoint import TOPIC_CONFIG, Checkpoint, _Newest, checkpoint_topic, judge
from cdc.relay.exactly_once import (
    CheckpointTracker,
    RelayFencedError,
    is_fenced,
    transactional_id,
)
from cdc.relay.transactional import PresentIds, Transactions, _Ids
from cdc.relay.transactional import transactional_id as republish_id
from cdc.relay.txbatch import Action, TxBatch, TxLimits
from cdc.settings import Settings, build, default_checkpoint_topic
from sinks.kafka.config import consumer_config

LIMITS = TxLimits(
    max_records=10, max_ms=50, backlog_max_ms=500, abort_after_ms=1_000, commit_budget_ms=100
)


def _settings(**values: object) -> Settings:
    return build(Settings, kafka_bootstrap_servers="k:9092", **values)


def test_the_transactional_id_is_the_system_and_the_slot_unless_configured() -> None:
    origin = Origin("7714869915919296735", 3, "outbox_slot")
    assert (
        transactional_id("", origin, "outbox_slot") == "outbox-cdc.7714869915919296735.outbox_slot"
    )
    assert transactional_id("mine", origin, "outbox_slot") == "mine"
    # (the timeline is not in it: a promoted standby's relay fences the old primary's)
    assert "3" not in transactional_id("", Origin("1", 3, "s"), "s").split(".")[1]


def test_republishing_runs_have_ids_of_their_own_never_the_streaming_relays() -> None:
    settings = _settings(slot="s1")
    assert republish_id(settings, "42", "recovery") == "outbox-cdc.42.s1.recovery"
    assert republish_id(settings, "42", "repair") == "outbox-cdc.42.s1.repair"


def test_the_checkpoint_topic_defaults_outside_the_sinks_subscription() -> None:
    settings = _settings()
    topic = checkpoint_topic(settings)
    assert topic == "__outbox_cdc_checkpoints.outbox.event"
    assert not topic.startswith(settings.topic_prefix)
    assert checkpoint_topic(_settings(checkpoint_topic="cp")) == "cp"
    assert TOPIC_CONFIG["cleanup.policy"] == "compact"


@pytest.mark.parametrize(
    "prefix",
    [
        "outbox",
        "outbox.event.",
        "outbox.",
        "o",
        "_",
        "__",
        "__outbox_cdc",
        "outbox-cdc",
        "a b/c",
        "",
    ],
)
def test_the_default_checkpoint_topic_never_starts_with_the_topic_prefix(prefix: str) -> None:
    """The prefix "outbox" (no dot) made `outbox__checkpoints`: the sink's `^outbox.*`,
    the audit and the present-ids read took it for an outbox topic."""
    topic = default_checkpoint_topic(prefix)
    assert not prefix or not topic.startswith(prefix)
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic), topic
    assert not re.match(f"^{re.escape(prefix)}.*", topic) or not prefix
    assert default_checkpoint_topic("x" * 400).startswith("__outbox_cdc_checkpoints.x")
    assert len(default_checkpoint_topic("x" * 400)) == 249


def test_the_configured_checkpoint_topic_is_never_an_outbox_topic_even_under_the_prefix() -> None:
    settings = _settings(topic_prefix="outbox", checkpoint_topic="outbox__checkpoints")
    assert settings.is_outbox_topic("outbox.orders")
    assert not settings.is_outbox_topic("outbox__checkpoints")
    assert not _settings(topic_prefix="outbox", dlq_topic="outbox.dlq").is_outbox_topic(
        "outbox.dlq"
    )
    assert not _settings().is_outbox_topic("elsewhere.orders")


class _Topics:
    """A client whose metadata lists ``names`` (one partition each)."""

    def __init__(self, names: list[str]) -> None:
        self.topics = {n: type("T", (), {"partitions": {0: None}})() for n in names}

    def list_topics(self, timeout: float) -> _Topics:
        return self


def test_the_audit_never_reads_the_checkpoint_topic_as_an_outbox_topic() -> None:
    from cdc.audit.kafka import outbox_topics

    settings = _settings(topic_prefix="outbox", checkpoint_topic="outbox.checkpoints")
    client = _Topics(["outbox.orders", "outbox.checkpoints", "outbox.dlq", "other"])
    assert list(outbox_topics(client, settings)) == ["outbox.orders"]  # type: ignore[arg-type]
    settings = _settings(topic_prefix="outbox", dlq_topic="outbox.dlq")
    client = _Topics(["outbox.orders", default_checkpoint_topic("outbox"), "outbox.dlq"])
    assert list(outbox_topics(client, settings)) == ["outbox.orders"]  # type: ignore[arg-type]


def test_the_sink_skips_records_of_the_checkpoint_topic_its_pattern_matches() -> None:
    from sinks.core.delivery import Envelope
    from sinks.core.machine import Route
    from sinks.kafka.consumer import CHECKPOINT_RECORD, classifier

    class _Routing:
        def is_ignored(self, topic: str, event_type: str) -> bool:
            return False

        def route_envelope(self, record: Envelope) -> object:
            return type("Call", (), {"path": "/x"})()

    classify = classifier(_Routing(), "outbox.checkpoints")  # type: ignore[arg-type]
    checkpoint = Envelope(topic="outbox.checkpoints", partition=0, offset=1, key=b"o", value=b"0/1")
    assert classify(checkpoint).route is Route.IGNORE
    assert classify(checkpoint).reason == CHECKPOINT_RECORD
    event = Envelope(topic="outbox.orders", partition=0, offset=1, key=b"k", value=b"{}")
    assert classify(event).route is Route.DELIVER


ORIGIN = "7714869915919296735/1/outbox_slot"


def _newest(
    origin: bytes | None = ORIGIN.encode(), value: bytes = b"0/1000", *, unreadable: bool = False
) -> _Newest:
    return _Newest(offset=7, origin=origin, value=value, unreadable=unreadable)


def test_a_checkpoint_counts_when_its_origin_value_and_lsn_are_verified() -> None:
    assert judge(_newest(), ORIGIN, wal_bound=0x1000) == Checkpoint(0x1000)
    assert judge(None, ORIGIN, wal_bound=0x1000) == Checkpoint(None)


@pytest.mark.parametrize(
    ("newest", "reason"),
    [
        (_newest(origin=None), "no origin header"),
        (_newest(origin=b"7714869915919296735/1/other_slot"), "another origin header"),
        (_newest(value=b"not an lsn"), "no LSN"),
        (_newest(value=b"\xff\xfe"), "no LSN"),
        (_newest(unreadable=True), "headers cannot be read"),
        (_newest(value=b"0/1001"), "beyond the server's WAL position 0/1000"),
        (_newest(value=b"FFFFFFFF/FFFFFFFF"), "beyond"),
    ],
)
def test_a_checkpoint_not_verified_does_not_count_and_says_why(
    newest: _Newest, reason: str
) -> None:
    """A record under the relay's key it cannot vouch for must never move the start
    forward (a checkpoint ahead of the truth skips transactions not in Kafka: loss)."""
    found = judge(newest, ORIGIN, wal_bound=0x1000)
    assert found.lsn is None
    assert reason in found.distrusted
    assert found.where == "offset 7"


def test_present_ids_are_16_bytes_each_and_looked_up_exactly() -> None:
    ids = [uuid.uuid4().bytes for _ in range(5_000)] + [uuid.uuid1().bytes for _ in range(500)]
    present = PresentIds.of([*ids, ids[0]])
    assert len(present) == len(ids)
    assert all(i in present for i in ids)
    assert not any(uuid.uuid4().bytes in present for _ in range(2_000))
    assert None not in present and b"short" not in present and str(ids[0]) not in present
    assert uuid.uuid4().bytes not in PresentIds()  # (empty, frozen at its first lookup)
    with pytest.raises(RuntimeError):
        present.add(ids[0])


def _message(topic: str, headers: list[tuple[bytes, bytes]]) -> object:
    from tests.records import RawRecord
    from tests.unit.test_record_reading import FakeMessage

    class _At(FakeMessage):
        def topic(self) -> str:
            return topic

    return _At(RawRecord(key=b"k", value=b"{}", headers=tuple(headers)))


def test_only_the_relays_own_records_and_dead_letters_vouch_for_an_id() -> None:
    """A record of another producer or cluster carrying a row's id must not make recovery
    skip the row; a record whose header name is not UTF-8 (SystemError in headers())
    is passed by, counted, never fatal."""
    owner = Owner("7714869915919296735", frozenset({1, 2}), "outbox_slot")
    ids = {name: uuid.uuid4() for name in ("ours", "old_tli", "foreign", "none", "dlq", "bad")}

    def h(name: str, origin: str | None) -> list[tuple[bytes, bytes]]:
        out = [(b"id", str(ids[name]).encode())]
        return out + ([(b"origin", origin.encode())] if origin is not None else [])

    took = _Ids(owner, "outbox.dlq")
    for msg in [
        _message("outbox.event.o", h("ours", ORIGIN)),
        _message("outbox.event.o", h("old_tli", "7714869915919296735/2/outbox_slot")),
        _message("outbox.event.o", h("foreign", "1234/1/outbox_slot")),
        _message("outbox.event.o", h("none", None)),
        _message("outbox.dlq", h("dlq", None)),
        _message("outbox.event.o", [*h("bad", ORIGIN), (b"\xff\xfe", b"x")]),
        _message("outbox.event.o", [(b"id", b"not-a-uuid"), (b"origin", ORIGIN.encode())]),
    ]:
        took.take(msg)
    present = took.present.freeze()
    kept = {name for name, i in ids.items() if i.bytes in present}
    assert kept == {"ours", "old_tli", "dlq"}
    assert took.reader.skipped == {
        Skip.FOREIGN_ORIGIN: 1,
        Skip.NO_ORIGIN: 1,
        Skip.UNREADABLE_HEADERS: 1,
        Skip.BAD_ID: 1,
    }


def test_a_republisher_skips_an_id_only_when_it_is_present_as_bytes() -> None:
    present_id, missing_id = uuid.uuid4(), uuid.uuid4()
    txs = Transactions.__new__(Transactions)
    txs.present = PresentIds.of([present_id.bytes])
    txs.skipped = 0
    txs._open = True  # (no producer: a transaction counts as open)
    assert txs.skip(str(present_id)) and txs.skipped == 1
    assert txs.skip(str(present_id).upper())
    assert not txs.skip(str(missing_id))
    assert not txs.skip("not-a-uuid")


@pytest.mark.parametrize(
    "code", [KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH]
)
def test_fenced_errors_are_recognised_bare_or_raised(code: int) -> None:
    err = KafkaError(code)
    assert is_fenced(err)
    assert is_fenced(KafkaException(err))


def test_other_errors_are_not_fencing() -> None:
    assert not is_fenced(KafkaError(KafkaError._TIMED_OUT))
    assert not is_fenced(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    assert not is_fenced(ValueError("x"))


def test_fenced_is_a_cdc_error_that_ends_the_process() -> None:
    assert issubclass(RelayFencedError, CdcError)
    assert RelayFencedError.retriable is False


def test_the_tracker_never_confirms_past_the_committed_checkpoint_while_a_transaction_is_open() -> (
    None
):
    batch = TxBatch(LIMITS, 100)
    tracker = CheckpointTracker(100, batch)
    tracker.open(200)
    assert batch.wal_open
    assert batch.record(0) is Action.BEGIN
    tracker.add(200)
    tracker.ack(200)
    tracker.close(200, 210)
    assert batch.candidate == 210 and not batch.wal_open
    assert tracker.confirmable == 100  # delivered, not committed
    assert batch.due(LIMITS.max_ms) is Action.COMMIT
    batch.commit_ok()
    assert tracker.confirmable == 210
    tracker.observe_wal_end(500)  # idle: the WAL end may be confirmed
    assert tracker.confirmable == 500


def test_delivery_and_transaction_settings_are_validated() -> None:
    assert _settings().delivery == "at-least-once"
    assert _settings(delivery="exactly-once").delivery == "exactly-once"
    with pytest.raises(ConfigError, match="CDC_DELIVERY"):
        Settings.from_env({"CDC_DELIVERY": "twice"})
    with pytest.raises(ConfigError, match="CDC_TX_MAX_MS"):
        Settings.from_env({"CDC_TX_MAX_MS": "0"})


def test_the_sink_reads_committed_records_only() -> None:
    assert consumer_config(_settings())["isolation.level"] == "read_committed"


def test_the_exactly_once_shell_hands_records_to_the_relays_own_send() -> None:
    """The shell calls the relay's _send directly (not through super(): the hot path);
    a mixin that overrode it would be passed by - this notices one."""
    from cdc.relay import eos_steps, exactly_once
    from cdc.relay.fast_path import FastPath
    from cdc.relay.loop import Relay

    assert exactly_once._send_record is Relay._send
    assert eos_steps._send_record is Relay._send
    assert exactly_once._tracker_open is exactly_once.LsnTracker.open
    assert eos_steps._tracker_open is exactly_once.LsnTracker.open
    assert eos_steps._tracker_close is exactly_once.LsnTracker.close
    # (eos_steps reads Begin and Commit as FastPath does: no other mixin reads them)
    assert Relay._on_begin is FastPath._on_begin
    assert Relay._on_commit is FastPath._on_commit


def test_the_exactly_once_begin_and_commit_read_as_the_fast_path_and_ask_the_machine() -> None:
    """eos_steps' Begin and Commit leave the session and the tracker as FastPath's do
    (malformed messages refused the same way); the machine learns the WAL transaction
    began (covered or not) and ended, and what is due at its end."""
    import struct

    from cdc.errors import DecodeError
    from cdc.relay.eos_steps import EosSteps
    from cdc.relay.fast_path import FastPath
    from cdc.relay.state import Session
    from cdc.wal.lsn import LsnTracker

    acted: list[Action] = []

    class Steps(EosSteps):
        def __init__(self, checkpoint: int) -> None:
            # (never aborted by age: the record below is "opened" at 0 ms, the commit
            # asks with the monotonic clock)
            limits = TxLimits(
                max_records=10,
                max_ms=50,
                backlog_max_ms=500,
                abort_after_ms=1 << 60,
                commit_budget_ms=100,
            )
            self._batch = TxBatch(limits, checkpoint)
            self._skip_tx = -1
            self._job = None

        def _act(self, sess: Session, action: Action) -> None:
            acted.append(action)

    def begin(final_lsn: int) -> bytes:
        return b"B" + struct.pack(">QqI", final_lsn, 800_000_000_000_000, 7)

    def commit(final_lsn: int, end_lsn: int) -> bytes:
        return b"C" + struct.pack(">BQQq", 0, final_lsn, end_lsn, 800_000_000_000_000)

    for final_lsn, covered in ((0x100, True), (0x300, False)):
        steps = Steps(checkpoint=0x200)
        ours = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
        theirs = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
        steps._on_begin(ours, b"x" + begin(final_lsn), 1)
        FastPath._on_begin(theirs, b"x" + begin(final_lsn), 1)
        assert (ours.tx_id, ours.begin) == (theirs.tx_id, theirs.begin) == (final_lsn, ours.begin)
        assert steps._batch.wal_open
        assert steps._skip_tx == (final_lsn if covered else -1)
        if not covered:  # (a record in a Kafka transaction, old enough to commit at its end)
            assert steps._batch.record(0) is Action.BEGIN
            ours.tracker.add(final_lsn)
            theirs.tracker.add(final_lsn)
        ours.caught_up = True
        steps._on_commit(ours, commit(final_lsn, final_lsn + 0x28), 0)
        FastPath._on_commit(theirs, commit(final_lsn, final_lsn + 0x28), 0)
        assert (ours.tx_id, ours.begin, ours.tx) == (theirs.tx_id, theirs.begin, theirs.tx)
        assert ours.tx_id is None
        assert ours.tracker.end_lsn(final_lsn) == theirs.tracker.end_lsn(final_lsn)
        assert not steps._batch.wal_open
        if not covered:
            assert steps._batch.candidate == final_lsn + 0x28
    assert acted == [Action.COMMIT]  # (the uncovered one's: its Kafka transaction is due)
    steps = Steps(checkpoint=0)
    sess = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="outside a transaction"):
        steps._on_commit(sess, commit(0x100, 0x128), 0)
    with pytest.raises(DecodeError):
        steps._on_commit(sess, commit(0x100, 0x128)[:-1], 0)
    with pytest.raises(DecodeError):
        steps._on_begin(sess, begin(0x100)[:-1], 0)
