"""The pure parts of the ops tooling: durations, clamping, replay arithmetic, lag, order."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc.cli.render import fmt_age, fmt_bytes, fmt_offset
from cdc.settings import Settings
from sinks.core.delivery import Envelope
from sinks.ops.errors import OpsUsageError
from sinks.ops.offsets import (
    CommitRange,
    OffsetReset,
    PartitionLag,
    clamp_offset,
    commit_range,
    counting_position,
    lag_count,
    lag_rates,
    lag_totals,
    out_of_range_warning,
    partition_lag,
    resume_offset,
    sink_offset_reset,
)
from sinks.ops.plan import (
    PartitionAction,
    PartitionPlan,
    ReplayKind,
    ReplayPlan,
    ReplaySpec,
    group_is_active,
    partition_action,
    plan_partition,
    replay_target,
)
from sinks.ops.selection import (
    RedeliverySelector,
    TopicSelection,
    default_topic_filter,
    in_commit_order,
    named_partitions,
    parse_datetime_ms,
    parse_iso_duration_s,
    parse_topic_spec,
    select_topics,
)

EARLIEST = OffsetReset.EARLIEST

# --- ISO-8601 durations -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("PT15M", 900.0),
        ("P1D", 86_400.0),
        ("PT1H30M", 5_400.0),
        ("P1W", 604_800.0),
        ("PT0.5S", 0.5),
        ("PT1,5H", 5_400.0),
        ("P1DT2H3M4S", 86_400 + 7_200 + 180 + 4.0),
        ("pt15m", 900.0),
        (" PT10S ", 10.0),
        ("PT0S", 0.0),
    ],
)
def test_iso_duration_parses_to_seconds(text: str, seconds: float) -> None:
    assert parse_iso_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "P", "PT", "P1DT", "15M", "PT15", "-PT5M", "PT5M3H", "P1H", "PT1D", "P1.D"]
)
def test_malformed_iso_duration_is_refused(text: str) -> None:
    with pytest.raises(OpsUsageError, match="ISO-8601 duration"):
        parse_iso_duration_s(text)


@pytest.mark.parametrize("text", ["P1Y", "P2M", "P1Y2M3D", "P1MT5M"])
def test_years_and_months_are_refused_as_having_no_fixed_length(text: str) -> None:
    with pytest.raises(OpsUsageError, match="no fixed length"):
        parse_iso_duration_s(text)


@given(
    days=st.integers(0, 400),
    hours=st.integers(0, 23),
    minutes=st.integers(0, 59),
    seconds=st.integers(0, 59),
)
def test_every_day_time_duration_round_trips(
    days: int, hours: int, minutes: int, seconds: int
) -> None:
    text = f"P{days}DT{hours}H{minutes}M{seconds}S"
    assert parse_iso_duration_s(text) == days * 86_400 + hours * 3_600 + minutes * 60 + seconds


def test_naive_datetime_is_utc_and_offsets_are_honoured() -> None:
    expected = int(datetime(2024, 5, 1, 10, 0, tzinfo=UTC).timestamp() * 1000)
    assert parse_datetime_ms("2024-05-01T10:00:00") == expected
    assert parse_datetime_ms("2024-05-01T12:00:00+02:00") == expected
    assert parse_datetime_ms("2024-05-01T10:00:00Z") == expected
    with pytest.raises(OpsUsageError, match="ISO-8601 date-time"):
        parse_datetime_ms("yesterday")


# --- topics -------------------------------------------------------------------------------


def test_topic_spec_names_a_topic_and_optionally_partitions() -> None:
    assert parse_topic_spec("t.user") == TopicSelection(topic="t.user")
    assert parse_topic_spec("t.user:2,0,2") == TopicSelection(topic="t.user", partitions=(0, 2))
    for bad in (":1", "t:", "t:a", "t:-1"):
        with pytest.raises(OpsUsageError):
            parse_topic_spec(bad)


def test_default_topics_are_the_prefixed_ones_never_internal() -> None:
    names = ["outbox.event.user", "outbox.event.quiz_attempt", "outbox.dlq", "__consumer_offsets"]
    accept = default_topic_filter(Settings(topic_prefix="outbox.event."))
    assert select_topics(names, accept) == ["outbox.event.quiz_attempt", "outbox.event.user"]
    by_pattern = default_topic_filter(Settings(sink_topics_pattern="^outbox\\.(event|dlq)"))
    assert select_topics(names, by_pattern) == [
        "outbox.dlq",
        "outbox.event.quiz_attempt",
        "outbox.event.user",
    ]


# --- offsets and lag ------------------------------------------------------------------------


def test_clamp_keeps_offsets_inside_the_watermarks() -> None:
    assert clamp_offset(-5, low=3, high=10) == 3
    assert clamp_offset(7, low=3, high=10) == 7
    assert clamp_offset(99, low=3, high=10) == 10


@pytest.mark.parametrize(
    ("spelling", "policy"),
    [
        ("earliest", OffsetReset.EARLIEST),
        ("smallest", OffsetReset.EARLIEST),
        ("Beginning", OffsetReset.EARLIEST),
        ("latest", OffsetReset.LATEST),
        ("largest", OffsetReset.LATEST),
        ("end", OffsetReset.LATEST),
        ("error", OffsetReset.ERROR),
    ],
)
def test_every_librdkafka_spelling_of_auto_offset_reset_is_understood(
    spelling: str, policy: OffsetReset
) -> None:
    assert OffsetReset.parse(spelling) is policy


def test_an_unknown_auto_offset_reset_is_a_usage_error() -> None:
    with pytest.raises(OpsUsageError, match=r"auto\.offset\.reset 'sometimes'"):
        OffsetReset.parse("sometimes")


def test_the_sinks_reset_policy_is_read_from_its_consumer_configuration() -> None:
    assert sink_offset_reset(Settings()) is OffsetReset.EARLIEST  # sinks/runtime/sink.py today
    overridden = Settings(kafka_config={"auto.offset.reset": "largest"})
    assert sink_offset_reset(overridden) is OffsetReset.LATEST


def test_a_commit_is_classified_against_the_watermarks() -> None:
    assert commit_range(None, low=30, high=100) is CommitRange.NONE
    assert commit_range(29, low=30, high=100) is CommitRange.BELOW_LOW
    assert commit_range(30, low=30, high=100) is CommitRange.IN_RANGE
    assert commit_range(100, low=30, high=100) is CommitRange.IN_RANGE  # at the end: waits
    assert commit_range(101, low=30, high=100) is CommitRange.PAST_END


@pytest.mark.parametrize(
    ("committed", "reset", "resume"),
    [
        (50, OffsetReset.EARLIEST, 50),  # in range: the commit, whatever the policy
        (50, OffsetReset.LATEST, 50),
        (50, OffsetReset.ERROR, 50),
        (None, OffsetReset.EARLIEST, 30),  # never committed: the policy
        (None, OffsetReset.LATEST, 100),
        (None, OffsetReset.ERROR, None),
        (10, OffsetReset.EARLIEST, 30),  # below the low watermark: the policy
        (10, OffsetReset.LATEST, 100),
        (700, OffsetReset.EARLIEST, 30),  # past the end: the policy, NOT the end
        (700, OffsetReset.LATEST, 100),
        (700, OffsetReset.ERROR, None),
    ],
)
def test_the_consumer_resumes_at_an_in_range_commit_else_where_the_policy_sends_it(
    committed: int | None, reset: OffsetReset, resume: int | None
) -> None:
    assert resume_offset(committed, low=30, high=100, reset=reset) == resume


def test_lag_counts_from_where_the_consumer_really_resumes() -> None:
    assert lag_count(None, low=4, high=9, reset=EARLIEST) == 5
    assert lag_count(2, low=4, high=9, reset=EARLIEST) == 5  # its records were deleted
    assert lag_count(12, low=4, high=9, reset=EARLIEST) == 5  # past the end: all again
    assert lag_count(12, low=4, high=9, reset=OffsetReset.LATEST) == 0
    # a consumer that stops on the error still has its committed position to count from
    assert counting_position(12, low=4, high=9, reset=OffsetReset.ERROR) == 9
    assert counting_position(None, low=4, high=9, reset=OffsetReset.ERROR) == 4


def test_an_out_of_range_commit_is_explained_with_its_likely_causes() -> None:
    past = out_of_range_warning("t", 0, 700, low=0, high=200, reset=EARLIEST)
    below = out_of_range_warning("t", 1, 10, low=30, high=100, reset=EARLIEST)
    latest = out_of_range_warning("t", 1, 10, low=30, high=100, reset=OffsetReset.LATEST)
    stops = out_of_range_warning("t", 1, 10, low=30, high=100, reset=OffsetReset.ERROR)
    assert past is not None and below is not None and latest is not None and stops is not None
    assert "t[0]: committed offset 700 is past the end 200 (out of range)" in past
    assert "recreated" in past and "truncated" in past
    assert "resumes at the low watermark 0 (auto.offset.reset=earliest)" in past
    assert "records 10..29 were deleted (retention, DeleteRecords)" in below
    assert "resumes at the low watermark 30" in below
    assert "skips the 70 record(s)" in latest
    assert "stops on this partition" in stops
    assert out_of_range_warning("t", 0, 50, low=0, high=200, reset=EARLIEST) is None
    assert out_of_range_warning("t", 0, None, low=0, high=200, reset=EARLIEST) is None


def _lag_row(
    committed: int | None, *, low: int = 0, high: int, first_ts_ms: int | None, now_ms: int
) -> PartitionLag:
    """One partition's lag row under the sink's policy today (earliest)."""
    return partition_lag(
        topic="t",
        partition=0,
        committed=committed,
        low=low,
        high=high,
        reset=EARLIEST,
        first_ts_ms=first_ts_ms,
        now_ms=now_ms,
    )


def test_caught_up_partition_has_zero_lag_and_zero_age() -> None:
    row = _lag_row(5, high=5, first_ts_ms=1_000, now_ms=9_000)
    assert (row.lag, row.oldest_unprocessed_age_s, row.oldest_unprocessed_ts_ms) == (0, 0.0, None)
    assert (row.resume_offset, row.warning) == (5, None)


def test_lagging_partition_age_is_now_minus_first_unprocessed_timestamp() -> None:
    row = _lag_row(2, high=5, first_ts_ms=1_000, now_ms=61_000)
    assert (row.lag, row.oldest_unprocessed_age_s) == (3, 60.0)
    unknown = _lag_row(None, high=5, first_ts_ms=None, now_ms=61_000)
    assert (unknown.lag, unknown.oldest_unprocessed_age_s) == (5, None)


def test_lag_row_of_a_commit_past_the_end_reports_the_real_resume_point_and_warns() -> None:
    row = _lag_row(700, high=200, first_ts_ms=1_000, now_ms=11_000)
    assert (row.resume_offset, row.lag, row.position) == (0, 200, 0)
    assert row.oldest_unprocessed_age_s == 10.0
    assert row.commit_range is CommitRange.PAST_END
    assert row.warning is not None and "past the end 200" in row.warning
    assert row.as_json()["resume_offset"] == 0
    assert row.as_json()["commit_range"] == "past_end"


def _lag(partition: int, committed: int | None, high: int, age: float | None) -> PartitionLag:
    return PartitionLag(
        topic="t",
        partition=partition,
        committed_offset=committed,
        low_offset=0,
        end_offset=high,
        resume_offset=resume_offset(committed, low=0, high=high, reset=EARLIEST),
        lag=lag_count(committed, low=0, high=high, reset=EARLIEST),
        oldest_unprocessed_ts_ms=None,
        oldest_unprocessed_age_s=age,
    )


def test_totals_sum_lag_and_take_the_oldest_age() -> None:
    totals = lag_totals([_lag(0, 5, 5, 0.0), _lag(1, 2, 9, 30.0), _lag(2, None, 4, 90.0)])
    assert (totals.lag, totals.oldest_unprocessed_age_s) == (11, 90.0)
    assert (totals.partitions, totals.lagging_partitions) == (3, 2)
    assert lag_totals([]).oldest_unprocessed_age_s == 0.0


def test_rates_are_offset_growth_per_second() -> None:
    rates = lag_rates([_lag(0, 10, 100, 1.0)], [_lag(0, 30, 140, 1.0)], elapsed_s=2.0)
    assert rates[("t", 0)].produced_per_s == 20.0
    assert rates[("t", 0)].processed_per_s == 10.0
    assert lag_rates([], [_lag(0, 1, 2, 0.0)], elapsed_s=2.0) == {}
    assert lag_rates([_lag(0, 1, 2, 0.0)], [_lag(0, 1, 2, 0.0)], elapsed_s=0) == {}


# --- replay targets and plans ------------------------------------------------------------------


def test_each_target_kind_resolves_inside_the_watermarks() -> None:
    def target(spec: ReplaySpec, current: int | None = 6, time_offset: int | None = None) -> int:
        return replay_target(spec, current=current, low=3, high=10, time_offset=time_offset)

    assert target(ReplaySpec(kind=ReplayKind.EARLIEST)) == 3
    assert target(ReplaySpec(kind=ReplayKind.LATEST)) == 10
    assert target(ReplaySpec(kind=ReplayKind.OFFSET, value=1)) == 3
    assert target(ReplaySpec(kind=ReplayKind.OFFSET, value=8)) == 8
    assert target(ReplaySpec(kind=ReplayKind.OFFSET, value=80)) == 10
    assert target(ReplaySpec(kind=ReplayKind.SHIFT, value=-2)) == 4
    assert target(ReplaySpec(kind=ReplayKind.SHIFT, value=-20)) == 3
    assert target(ReplaySpec(kind=ReplayKind.SHIFT, value=20)) == 10
    assert target(ReplaySpec(kind=ReplayKind.SHIFT, value=2), current=None) == 5  # from low
    at = ReplaySpec(kind=ReplayKind.DATETIME, value=1_000)
    assert target(at, time_offset=7) == 7
    assert target(at, time_offset=None) == 10  # no record that recent: the end
    assert target(at, time_offset=-1) == 10
    assert target(at, time_offset=0) == 3  # below a deleted head: clamped


def test_shift_of_an_out_of_range_commit_is_kafkas_committed_plus_n_then_clamped() -> None:
    def shift(current: int, by: int, *, low: int, high: int) -> int:
        spec = ReplaySpec(kind=ReplayKind.SHIFT, value=by)
        return replay_target(spec, current=current, low=low, high=high, time_offset=None)

    # the numbers, checked against kafka-consumer-groups 4.1.1
    assert shift(700, -50, low=0, high=200) == 200  # not 150 (end - 50)
    assert shift(700, +50, low=0, high=200) == 200
    assert shift(10, +50, low=30, high=100) == 60  # not 80 (low + 50)
    assert shift(10, -50, low=30, high=100) == 30


def test_time_targets_resolve_against_now() -> None:
    assert ReplaySpec(kind=ReplayKind.DATETIME, value=5).timestamp_ms(now_ms=99) == 5
    assert ReplaySpec(kind=ReplayKind.DURATION, value=900_000).timestamp_ms(now_ms=1_000_000) == (
        100_000
    )
    assert ReplaySpec(kind=ReplayKind.SHIFT, value=1).timestamp_ms(now_ms=1) is None


def test_spec_from_cli_option_parses_its_value() -> None:
    assert ReplaySpec.from_option(ReplayKind.DURATION, "PT15M").value == 900_000
    assert ReplaySpec.from_option(ReplayKind.DURATION, "PT1.5H").value == 5_400_000
    assert ReplaySpec.from_option(ReplayKind.DURATION, "P1W").value == 604_800_000
    assert ReplaySpec.from_option(ReplayKind.SHIFT, "-5").value == -5
    assert ReplaySpec.from_option(ReplayKind.SHIFT, "+5").value == 5
    assert ReplaySpec.from_option(ReplayKind.OFFSET, "42").value == 42
    assert ReplaySpec.from_option(ReplayKind.EARLIEST).kind is ReplayKind.EARLIEST
    with pytest.raises(OpsUsageError, match="not negative"):
        ReplaySpec.from_option(ReplayKind.OFFSET, "-1")
    with pytest.raises(OpsUsageError, match="not an integer"):
        ReplaySpec.from_option(ReplayKind.SHIFT, "ten")
    with pytest.raises(OpsUsageError, match="ISO-8601 duration"):
        ReplaySpec.from_option(ReplayKind.DURATION, "-PT10M")


def test_from_earliest_if_uncommitted_goes_with_a_shift_only_and_shows_in_the_plan() -> None:
    spec = ReplaySpec.from_option(ReplayKind.SHIFT, "+5", from_earliest_if_uncommitted=True)
    assert spec.describe() == "--shift-by +5 --from-earliest-if-uncommitted"
    assert ReplaySpec.from_option(ReplayKind.SHIFT, "+5").describe() == "--shift-by +5"
    with pytest.raises(OpsUsageError, match="with --shift-by only"):
        ReplaySpec.from_option(ReplayKind.EARLIEST, from_earliest_if_uncommitted=True)


def _row(
    spec: ReplaySpec, *, current: int | None, low: int, high: int, named: bool = False
) -> PartitionPlan:
    """One partition's plan under the sink's policy today (earliest)."""
    return plan_partition(
        spec,
        topic="t",
        partition=1,
        current=current,
        low=low,
        high=high,
        reset=EARLIEST,
        named=named,
    )


def test_plan_counts_records_to_deliver_again_and_to_skip() -> None:
    back = _row(ReplaySpec(kind=ReplayKind.SHIFT, value=-4), current=7, low=0, high=10)
    assert (back.target_offset, back.redeliver_count, back.skip_count, back.changes) == (
        3,
        4,
        0,
        True,
    )
    ahead = _row(ReplaySpec(kind=ReplayKind.LATEST), current=None, low=2, high=10, named=True)
    assert (ahead.current_offset, ahead.target_offset) == (None, 10)
    assert (ahead.redeliver_count, ahead.skip_count) == (0, 8)


def test_counts_are_measured_from_where_the_group_really_resumes() -> None:
    past_end = _row(ReplaySpec(kind=ReplayKind.SHIFT, value=-50), current=700, low=0, high=200)
    # today the sink resumes at 0 (earliest); Kafka's arithmetic commits 200: 200 skipped
    assert (past_end.resume_offset, past_end.target_offset) == (0, 200)
    assert (past_end.redeliver_count, past_end.skip_count) == (0, 200)
    assert past_end.note == "committed offset out of range"
    assert past_end.warning is not None and "past the end 200" in past_end.warning
    below = _row(ReplaySpec(kind=ReplayKind.EARLIEST), current=10, low=30, high=100)
    assert (below.resume_offset, below.target_offset, below.skip_count) == (30, 30, 0)


@pytest.mark.parametrize(
    ("kind", "current", "named", "include", "from_earliest", "action"),
    [
        (ReplayKind.DATETIME, 5, False, False, False, PartitionAction.MOVE),
        (ReplayKind.DATETIME, None, False, False, False, PartitionAction.UNTOUCHED),
        (ReplayKind.EARLIEST, None, False, False, False, PartitionAction.UNTOUCHED),
        (ReplayKind.DATETIME, None, True, False, False, PartitionAction.MOVE),
        (ReplayKind.DATETIME, None, False, True, False, PartitionAction.MOVE),
        (ReplayKind.SHIFT, 5, False, False, False, PartitionAction.MOVE),
        (ReplayKind.SHIFT, None, False, False, False, PartitionAction.UNTOUCHED),
        (ReplayKind.SHIFT, None, True, False, False, PartitionAction.REFUSED),
        (ReplayKind.SHIFT, None, False, True, False, PartitionAction.REFUSED),
        (ReplayKind.SHIFT, None, True, False, True, PartitionAction.MOVE),
        (ReplayKind.SHIFT, None, False, False, True, PartitionAction.UNTOUCHED),
    ],
)
def test_uncommitted_partitions_move_only_when_the_operator_says_so(
    kind: ReplayKind,
    current: int | None,
    named: bool,
    include: bool,
    from_earliest: bool,
    action: PartitionAction,
) -> None:
    spec = ReplaySpec(kind=kind, value=1, from_earliest_if_uncommitted=from_earliest)
    got = partition_action(spec, current=current, named=named, include_uncommitted=include)
    assert got is action


def _uncommitted(spec: ReplaySpec, *, named: bool) -> PartitionPlan:
    return _row(spec, current=None, low=30, high=100, named=named)


def test_untouched_and_refused_partitions_have_no_target_and_count_nothing() -> None:
    shift = ReplaySpec(kind=ReplayKind.SHIFT, value=50)
    untouched = _uncommitted(shift, named=False)
    refused = _uncommitted(shift, named=True)
    for row in (untouched, refused):
        assert (row.target_offset, row.redeliver_count, row.skip_count) == (None, 0, 0)
        assert not row.changes
    assert untouched.note == "not committed — untouched"
    assert refused.note == "not committed — shift refused"
    from_low = _uncommitted(
        ReplaySpec(kind=ReplayKind.SHIFT, value=50, from_earliest_if_uncommitted=True), named=True
    )
    assert (from_low.target_offset, from_low.skip_count) == (80, 50)
    assert from_low.note == "not committed — shifted from the low watermark 30"


def _plan(*rows: PartitionPlan) -> ReplayPlan:
    return ReplayPlan(
        group="g",
        spec=ReplaySpec(kind=ReplayKind.SHIFT, value=50),
        at_ms=None,
        partitions=rows,
        group_state="EMPTY",
        active_members=0,
    )


def test_a_plan_with_a_refused_shift_names_the_partitions_and_the_way_out() -> None:
    shift = ReplaySpec(kind=ReplayKind.SHIFT, value=50)
    rows = [
        plan_partition(
            shift, topic="t", partition=p, current=c, low=0, high=9, reset=EARLIEST, named=True
        )
        for p, c in ((0, 3), (1, None), (2, None))
    ]
    plan = _plan(*rows)
    assert plan.refusal is not None
    assert plan.refusal.startswith("cannot shift t[1], t[2]: the group has no committed offset")
    assert "--from-earliest-if-uncommitted" in plan.refusal
    assert plan.as_json()["refused"] is True
    assert _plan(rows[0]).refusal is None


def test_named_partitions_are_the_ones_listed_one_by_one() -> None:
    selections = [
        TopicSelection(topic="a"),
        TopicSelection(topic="b", partitions=(0, 2)),
    ]
    assert named_partitions(selections) == {("b", 0), ("b", 2)}
    assert named_partitions(None) == frozenset()


@given(
    low=st.integers(0, 1_000),
    span=st.integers(0, 1_000),
    current=st.one_of(st.none(), st.integers(0, 3_000)),
    kind=st.sampled_from(list(ReplayKind)),
    value=st.integers(-3_000, 3_000),
    time_offset=st.one_of(st.none(), st.integers(-1, 3_000)),
    reset=st.sampled_from(list(OffsetReset)),
    named=st.booleans(),
    include=st.booleans(),
    from_earliest=st.booleans(),
)
def test_every_plan_stays_in_the_watermarks_and_its_counts_add_up(
    low: int,
    span: int,
    current: int | None,
    kind: ReplayKind,
    value: int,
    time_offset: int | None,
    reset: OffsetReset,
    named: bool,
    include: bool,
    from_earliest: bool,
) -> None:
    high = low + span
    if kind is ReplayKind.OFFSET:
        value = abs(value)
    spec = ReplaySpec(
        kind=kind,
        value=value,
        from_earliest_if_uncommitted=from_earliest and kind is ReplayKind.SHIFT,
    )
    plan = plan_partition(
        spec,
        topic="t",
        partition=0,
        current=current,
        low=low,
        high=high,
        reset=reset,
        time_offset=time_offset,
        named=named,
        include_uncommitted=include,
    )
    assert plan.redeliver_count >= 0
    assert plan.skip_count >= 0
    if plan.target_offset is None:
        assert current is None  # only a never-committed partition is ever left alone
        assert plan.redeliver_count == plan.skip_count == 0
        return
    assert low <= plan.target_offset <= high
    assert plan.redeliver_count - plan.skip_count == plan.start_offset - plan.target_offset
    if current is None:
        assert named or include  # never moved unless the operator said so
        assert kind is not ReplayKind.SHIFT or spec.from_earliest_if_uncommitted
    if kind is ReplayKind.SHIFT and current is not None:
        assert plan.target_offset == clamp_offset(current + value, low=low, high=high)


def test_only_an_empty_or_dead_group_without_members_is_idle() -> None:
    assert not group_is_active("EMPTY", 0)
    assert not group_is_active("DEAD", 0)
    assert group_is_active("STABLE", 1)
    assert group_is_active("PREPARING_REBALANCE", 0)
    assert group_is_active("EMPTY", 1)


# --- redelivery selection and order --------------------------------------------------------------


def _uuid_of(name: str) -> str:
    """A uuid standing for ``name`` (an event id is a uuid: anything else is no id)."""
    try:
        return str(uuid.UUID(name))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, name))


def _names(records: list[Envelope]) -> list[str]:
    by_id = {_uuid_of(n): n for n in ("e1", "e2", "e3", "e4", "x", "y", "z")}
    return [by_id[r.event_id] for r in records]


def _rec(
    topic: str, partition: int, offset: int, key: str, event_id: str, lsn: str | None, ts: int
) -> Envelope:
    headers = {"id": _uuid_of(event_id).encode(), "type": b"UserRegistered"}
    if lsn is not None:
        headers["lsn"] = lsn.encode()
    return Envelope(
        topic=topic,
        partition=partition,
        offset=offset,
        key=key.encode(),
        value=b"{}",
        headers=headers,
        timestamp_ms=ts,
    )


def test_records_merge_in_commit_order_and_a_duplicate_id_is_sent_once() -> None:
    users = [_rec("user", 1, 0, "A", "e1", "0/100", 1_000)]
    quiz = [
        _rec("quiz", 0, 0, "A", "e2", "0/200", 1_000),
        _rec("quiz", 0, 1, "A", "e2", "0/200", 1_000),  # at-least-once duplicate
        _rec("quiz", 0, 2, "A", "e4", "0/400", 2_000),
    ]
    late_user = [_rec("user", 2, 5, "A", "e3", "0/300", 1_500)]
    ordered = in_commit_order([quiz, late_user, users])
    assert _names(ordered) == ["e1", "e2", "e3", "e4"]


def test_offset_order_within_a_partition_is_never_changed() -> None:
    part = [
        _rec("t", 0, 0, "A", "x", None, 5_000),
        _rec("t", 0, 1, "A", "y", None, 4_000),  # a clock step back: still after x
    ]
    other = [_rec("t", 1, 0, "A", "z", None, 4_500)]
    ordered = _names(in_commit_order([part, other]))
    assert ordered.index("x") < ordered.index("y")


def test_selector_takes_event_ids_or_a_key_never_both() -> None:
    event_id = uuid.uuid4()
    by_id = RedeliverySelector.of(event_ids=[str(event_id).upper()], key=None)
    assert by_id.matches(_rec("t", 0, 0, "K", str(event_id), None, 1))
    assert not by_id.matches(_rec("t", 0, 1, "K", str(uuid.uuid4()), None, 1))
    by_key = RedeliverySelector.of(event_ids=None, key="K")
    assert by_key.matches(_rec("t", 0, 0, "K", "a", None, 1))
    assert not by_key.matches(_rec("t", 0, 0, "KK", "a", None, 1))
    for event_ids, key in ((None, None), (["a"], "K")):
        with pytest.raises(OpsUsageError, match="exactly one"):
            RedeliverySelector.of(event_ids=event_ids, key=key)


# --- CLI formatting ----------------------------------------------------------------------------


def test_cli_formats_ages_sizes_and_missing_offsets() -> None:
    assert [fmt_age(s) for s in (None, 0.0, 12.34, 75, 7_300, 90_000)] == [
        "?",
        "0.0s",
        "12.3s",
        "1m15s",
        "2h01m",
        "1d01h",
    ]
    assert [fmt_bytes(n) for n in (None, 512, 1_536, 5 * 1024**3)] == [
        "?",
        "512 B",
        "1.5 KiB",
        "5.0 GiB",
    ]
    assert (fmt_offset(None), fmt_offset(7)) == ("-", "7")
