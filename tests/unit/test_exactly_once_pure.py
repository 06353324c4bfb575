"""Exactly-once mode's pure parts: names, fencing errors, the capped tracker, the settings."""

from __future__ import annotations

import contextlib
import re
import uuid
from typing import Any, NoReturn

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc.errors import CdcError, ConfigError
from cdc.evidence import Origin, Owner
from cdc.records import Skip
from cdc.relay.delivery.checkpoint import TOPIC_CONFIG, Checkpoint, _Newest, checkpoint_topic, judge
from cdc.relay.delivery.exactly_once import (
    CheckpointTracker,
    RelayFencedError,
    is_fenced,
    transactional_id,
)
from cdc.relay.delivery.txbatch import Action, TxBatch, TxLimits
from cdc.repair.transactional import PresentIds, Transactions, _Ids
from cdc.repair.transactional import transactional_id as republish_id
from cdc.settings import Settings, build
from cdc.settings.checkpoint_names import default_checkpoint_topic
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
    assert topic == "__outbox_cdc_checkpoints.outbox.event.outbox_slot"
    assert not topic.startswith(settings.topic_prefix)
    assert checkpoint_topic(_settings(checkpoint_topic="cp")) == "cp"
    assert TOPIC_CONFIG["cleanup.policy"] == "compact"


def test_sharded_relays_have_a_checkpoint_topic_each_and_know_the_shared_one_of_before() -> None:
    """The sharding recipe gives every shard the same prefix: one shared checkpoint
    partition let another shard's open transaction hide this one's checkpoints."""
    shard_0, shard_1 = _settings(slot="outbox_slot_0"), _settings(slot="outbox_slot_1")
    assert checkpoint_topic(shard_0) != checkpoint_topic(shard_1)
    assert shard_0.shared_checkpoint_topic == "__outbox_cdc_checkpoints.outbox.event"
    assert shard_0.shared_checkpoint_topic == shard_1.shared_checkpoint_topic
    assert _settings(checkpoint_topic="cp").shared_checkpoint_topic is None
    for name in (checkpoint_topic(shard_1), "__outbox_cdc_checkpoints.outbox.event"):
        assert shard_0.is_checkpoint_topic(name), name  # (a sibling's: no event in it)
        assert not shard_0.is_outbox_topic(name)
    assert not shard_0.is_checkpoint_topic("outbox.event.orders")


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
    for slot in ("", "outbox_slot", "s"):
        topic = default_checkpoint_topic(prefix, slot)
        assert not prefix or not topic.startswith(prefix)
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic), topic
        assert not re.match(f"^{re.escape(prefix)}.*", topic) or not prefix
        assert topic.endswith(f".{slot}" if slot else "")
    assert default_checkpoint_topic("x" * 400).startswith("__outbox_cdc_checkpoints.x")
    assert len(default_checkpoint_topic("x" * 400)) == 249
    assert default_checkpoint_topic("x" * 400, "slot_1").endswith("x.slot_1")
    assert len(default_checkpoint_topic("x" * 400, "slot_1")) == 249


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
    from sinks.core.machine import Disposition
    from sinks.runtime.verdicts import CHECKPOINT_RECORD, classifier

    class _Routing:
        def is_ignored(self, topic: str, event_type: str) -> bool:
            return False

        def route_envelope(self, record: Envelope) -> object:
            return type("Call", (), {"path": "/x"})()

    settings = _settings(topic_prefix="outbox.", checkpoint_topic="outbox.checkpoints")
    classify = classifier(_Routing(), settings.is_checkpoint_topic)  # type: ignore[arg-type]
    checkpoint = Envelope(topic="outbox.checkpoints", partition=0, offset=1, key=b"o", value=b"0/1")
    assert classify(checkpoint).disposition is Disposition.IGNORE
    assert classify(checkpoint).reason == CHECKPOINT_RECORD
    event = Envelope(topic="outbox.orders", partition=0, offset=1, key=b"k", value=b"{}")
    assert classify(event).disposition is Disposition.DELIVER


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


def test_present_ids_decide_by_the_whole_id_when_the_bitmap_says_maybe() -> None:
    """Ids sharing the bitmap's bytes (its bit set for all of them) or a blob are told
    apart by all 16 bytes: the bitmap never answers "there"."""
    base = uuid.uuid4().bytes
    kept = [bytes([i]) + base[1:] for i in range(0, 256, 2)]  # same last bytes, same blob?
    present = PresentIds.of(kept)
    assert all(i in present for i in kept)
    assert not any(bytes([i]) + base[1:] in present for i in range(1, 256, 2))
    assert base[:15] + bytes([base[15] ^ 1]) not in present  # (another bit of the map)


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


def test_the_exactly_once_mode_hands_records_to_the_producers_own_send() -> None:
    """The mode calls the producer's send directly (bound once, no wrapper: the hot
    path), reads Begin and Commit itself (its own wal_begins, wal_ends), and the loop
    and the decoder call the mode's steps - no part of the relay overrides another's."""
    from cdc.relay.delivery import eos_steps
    from cdc.relay.delivery.exactly_once import ExactlyOnce, ExactlyOnceRelay
    from cdc.relay.stream import at_least_once, fast_path

    relay = ExactlyOnceRelay(
        _settings(delivery="exactly-once", pg_dsn="postgresql://x"), serve_http=False
    )
    eos = relay.mode
    assert isinstance(eos, ExactlyOnce)
    assert eos._steps._send_record == relay.producing.send
    # (its points are its collaborators' bound methods: the loop calls them directly)
    assert eos.record == eos._steps.record and eos.read_wait_s == eos._overlap.read_wait_s
    assert relay.producing.mode is relay.dead_letters.mode is eos
    assert relay.decoder._send == eos.record
    assert relay.decoder.on_begin == eos.wal_begins
    assert relay.decoder.on_commit == eos.wal_ends
    assert eos_steps._tracker_open is eos_steps.LsnTracker.open
    assert eos_steps._tracker_close is eos_steps.LsnTracker.close
    # (at-least-once reads Begin and Commit with the fast path's functions)
    assert at_least_once.AtLeastOnce.wal_begins is fast_path.read_begin
    assert at_least_once.AtLeastOnce.wal_ends is fast_path.read_commit


def _machine_in(state: str, limits: TxLimits, *, buffered: int = 0, nbytes: int = 0) -> TxBatch:
    """A machine driven into ``state`` (COMMITTING with ``buffered`` records of
    ``nbytes`` each held already) by its own steps."""
    batch = TxBatch(limits, 0x200)
    if state == "idle":
        return batch
    batch.wal_opened()
    assert batch.record(10) is Action.BEGIN
    batch.wal_closed(0x300)
    if state == "open":
        return batch
    if state in ("committing", "aborting", "failed"):
        assert batch.flush(20) is Action.COMMIT
        for _ in range(buffered):
            assert batch.record(30, nbytes) is Action.BUFFER
        if state == "committing":
            return batch
        assert batch.failed() is Action.ABORT
        if state == "aborting":
            return batch
        assert batch.aborted() is Action.RESTART
        return batch
    assert batch.fenced() is Action.EXIT
    return batch


_RECORD_CASES = [
    ("idle", 0, 0, 5),
    ("open", 0, 0, 5),
    ("committing", 0, 0, 5),  # the buffer's first record: the machine's (its clock)
    ("committing", 1, 5, 5),
    ("committing", 2, 5, 90),  # exactly at the bytes bound: still buffered
    ("committing", 2, 5, 91),  # past the bytes bound: WAIT
    ("committing", 3, 1, 1),  # at the records bound: WAIT
    ("aborting", 0, 0, 5),
    ("failed", 0, 0, 5),
    ("fenced", 0, 0, 5),
]


def _unused(*args: object) -> NoReturn:
    raise AssertionError(f"not called here: {args}")


def _steps(batch: TxBatch, **given: Any) -> Any:
    """EosSteps over ``batch``: every collaborator not ``given`` fails the test if called
    (the commit thread: not running)."""
    from cdc.relay.delivery.eos_steps import EosSteps

    parts: dict[str, Any] = dict.fromkeys(
        ("send_record", "hold", "serve", "act", "admit", "refuse"), _unused
    )
    parts["commit_thread_running"] = lambda: False
    return EosSteps(batch=batch, **{**parts, **given})


@pytest.mark.parametrize(("state", "buffered", "held_bytes", "nbytes"), _RECORD_CASES)
def test_the_record_step_leaves_the_machine_as_its_record_call_would(
    monkeypatch: pytest.MonkeyPatch, state: str, buffered: int, held_bytes: int, nbytes: int
) -> None:
    """EosSteps.record writes two of TxBatch.record's cases out (OPEN; a commit under
    way with records held and room for one more): in every state the machine ends as
    the call would leave it, the answer acted on the same way - sent, held, or handed
    to the admission rule (BEGIN, WAIT, REFUSE: ExactlyOnce._admit)."""
    from cdc.relay.delivery import eos_steps
    from cdc.relay.health.state import Session
    from cdc.wal.lsn import LsnTracker

    limits = TxLimits(
        max_records=10,
        max_ms=50,
        backlog_max_ms=500,
        abort_after_ms=1 << 60,
        commit_budget_ms=1 << 60,
        buffer_max_records=3,
        buffer_max_bytes=100,
    )
    monkeypatch.setattr(eos_steps, "_monotonic_ns", lambda: 40_000_000)  # (40 ms)
    did: list[object] = []

    def admit(sess: Session, n: int, action: Action) -> Action:
        did.append(("admit", action))
        # (as ExactlyOnce._admit: BEGIN begun, then into it; WAIT waited out - here the
        # commit still under way, and the record buffered when asked again)
        return {Action.BEGIN: Action.NONE, Action.WAIT: Action.BUFFER}.get(action, action)

    def refuse(sess: Session) -> NoReturn:
        did.append("refused")
        raise RuntimeError("refused")

    ours = _machine_in(state, limits, buffered=buffered, nbytes=held_bytes)
    steps = _steps(
        ours,
        send_record=lambda *args: did.append("sent"),
        hold=lambda held: did.append("held"),
        admit=admit,
        refuse=refuse,
    )
    sess = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
    value = b"v" * (nbytes - 1)
    with contextlib.suppress(RuntimeError):  # (refused: the stub raises, as _refuse does)
        steps.record(sess, 0x400, "t", value, b"k", [], 0, b"id")
    twin = _machine_in(state, limits, buffered=buffered, nbytes=held_bytes)
    answer = twin.record(40, nbytes)
    assert {slot: getattr(ours, slot) for slot in TxBatch.__slots__} == {
        slot: getattr(twin, slot) for slot in TxBatch.__slots__
    }
    expected = {
        Action.NONE: ["sent"],
        Action.BUFFER: ["held"],
        Action.BEGIN: [("admit", Action.BEGIN), "sent"],
        Action.REFUSE: [("admit", Action.REFUSE), "refused"],
        Action.WAIT: [("admit", Action.WAIT), "held"],
    }[answer]
    assert did == expected, (answer, did)


def test_the_begin_step_skips_exactly_what_the_machine_covers() -> None:
    """EosSteps.wal_begins writes TxBatch.opened out: the WAL transaction open, and its
    records skipped exactly when covered() says so (strictly below the checkpoint)."""
    import struct

    from cdc.relay.health.state import Session
    from cdc.wal.lsn import LsnTracker

    limits = TxLimits(
        max_records=10, max_ms=50, backlog_max_ms=500, abort_after_ms=1000, commit_budget_ms=100
    )

    for final_lsn in (0x1FF, 0x200, 0x201, 0x100, 0x300):
        batch = TxBatch(limits, 0x200)
        steps = _steps(batch)
        sess = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
        begin = b"B" + struct.pack(">QqI", final_lsn, 800_000_000_000_000, 7)
        steps.wal_begins(sess, begin, 0)
        twin = TxBatch(limits, 0x200)
        covered = twin.opened(final_lsn)
        assert (batch.wal_open, steps._skip_tx == final_lsn) == (twin.wal_open, covered)


def test_the_exactly_once_begin_and_commit_read_as_the_fast_path_and_ask_the_machine() -> None:
    """eos_steps' Begin and Commit leave the session and the tracker as the fast path's do
    (malformed messages refused the same way); the machine learns the WAL transaction
    began (covered or not) and ended, and what is due at its end."""
    import struct

    from cdc.errors import DecodeError
    from cdc.relay.delivery.eos_steps import EosSteps
    from cdc.relay.health.state import Session
    from cdc.relay.stream.fast_path import read_begin, read_commit
    from cdc.wal.lsn import LsnTracker

    acted: list[Action] = []

    def steps_at(checkpoint: int) -> EosSteps:
        # (never aborted by age: the record below is "opened" at 0 ms, the commit
        # asks with the monotonic clock)
        limits = TxLimits(
            max_records=10,
            max_ms=50,
            backlog_max_ms=500,
            abort_after_ms=1 << 60,
            commit_budget_ms=100,
        )

        return _steps(TxBatch(limits, checkpoint), act=lambda sess, action: acted.append(action))

    def begin(final_lsn: int) -> bytes:
        return b"B" + struct.pack(">QqI", final_lsn, 800_000_000_000_000, 7)

    def commit(final_lsn: int, end_lsn: int) -> bytes:
        return b"C" + struct.pack(">BQQq", 0, final_lsn, end_lsn, 800_000_000_000_000)

    for final_lsn, covered in ((0x100, True), (0x300, False)):
        steps = steps_at(0x200)
        ours = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
        theirs = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
        steps.wal_begins(ours, b"x" + begin(final_lsn), 1)
        read_begin(theirs, b"x" + begin(final_lsn), 1)
        assert (ours.tx_id, ours.begin) == (theirs.tx_id, theirs.begin) == (final_lsn, ours.begin)
        assert steps._batch.wal_open
        assert steps._skip_tx == (final_lsn if covered else -1)
        if not covered:  # (a record in a Kafka transaction, old enough to commit at its end)
            assert steps._batch.record(0) is Action.BEGIN
            ours.tracker.add(final_lsn)
            theirs.tracker.add(final_lsn)
        ours.caught_up = True
        steps.wal_ends(ours, commit(final_lsn, final_lsn + 0x28), 0)
        read_commit(theirs, commit(final_lsn, final_lsn + 0x28), 0)
        assert (ours.tx_id, ours.begin, ours.tx) == (theirs.tx_id, theirs.begin, theirs.tx)
        assert ours.tx_id is None
        assert ours.tracker.end_lsn(final_lsn) == theirs.tracker.end_lsn(final_lsn)
        assert not steps._batch.wal_open
        if not covered:
            assert steps._batch.candidate == final_lsn + 0x28
    assert acted == [Action.COMMIT]  # (the uncovered one's: its Kafka transaction is due)
    steps = steps_at(0)
    sess = Session(stream=None, tracker=LsnTracker(0))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="outside a transaction"):
        steps.wal_ends(sess, commit(0x100, 0x128), 0)
    with pytest.raises(DecodeError):
        steps.wal_ends(sess, commit(0x100, 0x128)[:-1], 0)
    with pytest.raises(DecodeError):
        steps.wal_begins(sess, begin(0x100)[:-1], 0)


def test_a_moved_epoch_is_a_takeover_unless_our_own_transaction_outlived_the_timeout() -> None:
    from cdc.relay.delivery.epoch import is_takeover

    timeout = 60_000
    # another session holds the slot, or who does cannot be read: fenced
    assert is_takeover(slot_taken=True, tx_age_ms=10 * timeout, timeout_ms=timeout)
    assert is_takeover(slot_taken=None, tx_age_ms=10 * timeout, timeout_ms=timeout)
    # our session holds it, but no transaction of ours can have timed out: someone
    # else took our transactional.id
    assert is_takeover(slot_taken=False, tx_age_ms=None, timeout_ms=timeout)
    assert is_takeover(slot_taken=False, tx_age_ms=timeout - 1, timeout_ms=timeout)
    # our transaction was open past the timeout, nobody else holds the slot: the
    # coordinator aborted it
    assert not is_takeover(slot_taken=False, tx_age_ms=timeout, timeout_ms=timeout)


def test_a_new_timeline_inherits_its_ancestors_checkpoint_only_up_to_the_fork() -> None:
    """After a failover the new timeline's origin has no checkpoint: the nearest
    ancestor's counts, judged under its own origin, capped where that timeline ended
    (the same WAL before it); a forged ancestor record counts for nothing."""
    from cdc.relay.delivery.checkpoint import choose

    old, older = "7/2/outbox_slot", "7/1/outbox_slot"
    ancestors = [(old, 0x5000), (older, 0x3000)]
    behind = {old: _newest(old.encode(), b"0/4000")}
    assert choose(behind, ORIGIN_3, ancestors, 0x9000).lsn == 0x4000
    beyond = {old: _newest(old.encode(), b"0/6000"), older: _newest(older.encode(), b"0/2000")}
    found = choose(beyond, ORIGIN_3, ancestors, 0x9000)
    assert (found.lsn, found.inherited, found.inherited_lsn, found.fork) == (
        0x5000,
        old,
        0x6000,
        0x5000,
    )
    only_older = {older: _newest(older.encode(), b"0/3800")}
    assert choose(only_older, ORIGIN_3, ancestors, 0x9000).lsn == 0x3000
    forged = {old: _newest(b"someone/else", b"0/4000")}
    assert choose(forged, ORIGIN_3, ancestors, 0x9000).lsn is None
    own = {ORIGIN_3: _newest(ORIGIN_3.encode(), b"0/7000"), old: _newest(old.encode(), b"0/4000")}
    assert choose(own, ORIGIN_3, ancestors, 0x9000).lsn == 0x7000
    assert choose({}, ORIGIN_3, ancestors, 0x9000).lsn is None


ORIGIN_3 = "7/3/outbox_slot"


def test_a_checkpoint_counts_only_as_far_as_the_relays_own_records_show_it() -> None:
    """DESIGN relay invariant 13: the data records of a Kafka transaction commit with its
    checkpoint. A checkpoint beyond the relay's own streamed records (a forged one, or
    one of a history the server lost) counts up to those records, or the slot's
    confirmed position; one they reach counts whole."""
    from cdc.relay.delivery.checkpoint import provable

    # the relay's newest own record (its WAL transaction at 0x500) and the checkpoint
    # right after it (the transaction's end): the checkpoint counts (covered: < 0x501)
    assert provable(0x510, confirmed=0x100, streamed=0x500) == 0x501
    assert provable(0x400, confirmed=0x100, streamed=0x500) == 0x400
    # forged ahead: the records reach 0x500 only
    assert provable(0x9000, confirmed=0x100, streamed=0x500) == 0x501
    # no record of the relay's at all: nothing is skipped past the slot's position
    assert provable(0x9000, confirmed=0x100, streamed=0) == 0x100
    assert provable(0x9000, confirmed=0x700, streamed=0x500) == 0x700
    # the newest records name rows the table no longer holds (a server rewound on the
    # same timeline): nothing at or beyond the first lost one is evidence
    rows = ((0x8000, False), (0x7000, False), (0x300, True), (0x200, True))
    assert provable(0x9000, confirmed=0x100, streamed=0x8000, rows=rows) == 0x301
    assert provable(0x9000, confirmed=0x100, streamed=0x8000, rows=((0x8000, False),)) == 0x100
    # the table keeps no rows: the records are the evidence
    assert provable(0x9000, confirmed=0x100, streamed=0x8000, rows=((0x8000, None),)) == 0x8001


class _InitialisedProducer:
    """A transactional producer whose init_transactions succeeded (nothing in flight)."""

    def __init__(self) -> None:
        self.purged = False

    def init_transactions(self, timeout: float) -> None:
        return None

    def poll(self, timeout: float = 0) -> int:
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True) -> None:
        self.purged = True

    def __len__(self) -> int:
        return 0


def test_a_session_whose_start_fails_after_init_transactions_lets_its_producer_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init_transactions succeeded, then the checkpoint could not be read: the producer
    is let go (purged, never kept for a later session, which makes a new one)."""
    from cdc.errors import KafkaUnavailableError
    from cdc.relay.delivery import checkpoint as ckpt
    from cdc.relay.delivery.exactly_once import ExactlyOnceRelay
    from cdc.relay.health.state import Session

    relay = ExactlyOnceRelay(
        _settings(delivery="exactly-once", pg_dsn="postgresql://x"), serve_http=False
    )
    producer = _InitialisedProducer()
    relay._producer = producer  # type: ignore[assignment]

    def unreadable(settings: Settings) -> str:
        raise KafkaUnavailableError("checkpoint topic: not reachable")

    monkeypatch.setattr(ckpt, "ensure_checkpoint_topic", unreadable)
    sess = Session(
        stream=None,  # type: ignore[arg-type]
        tracker=relay.mode.new_tracker(0),
        last_confirmed=0,
        origin=("origin", ORIGIN.encode()),
    )
    with pytest.raises(KafkaUnavailableError):
        relay._stream_loop(sess)
    assert relay._producer is None and relay.mode._initialised is None  # type: ignore[attr-defined]
    assert producer.purged
