"""The console's pipeline pages: the overview, lag, the audit.

Guarantees: every number shown is a field of the object handed in (the overview's
:class:`~sinks.console.views.Overview`, ``outbox-cdc lag``'s report, an audit's
``as_json``), escaped; what could not be read says so with its reason, never a zero;
the overview's live part (:func:`overview_fragment`) is what the browser fetches again
every :data:`~sinks.console.layout.REFRESH_S` seconds; the audit's repair is a second,
confirming form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from cdc.cli.render import gap_line, safe_size
from cdc.gaps import HistoryRow
from cdc.ops import SlotStatus
from sinks.console.history import SPARK_HEIGHT, SPARK_WIDTH, LagHistory, sparkline
from sinks.console.layout import (
    PREFIX,
    REFRESH_S,
    csrf_field,
    esc,
    facts,
    page,
    section,
    table,
    unknown,
    when,
)
from sinks.console.views import (
    LAG_SORT_KEYS,
    STATUSES,
    AuditMetricsView,
    Overview,
    Readout,
    RouteView,
    age_text,
    bytes_text,
)
from sinks.ops.lag import PipelineLag
from sinks.ops.offsets import PartitionLag
from sinks.parking.reasons import REASONS_SHOWN


# --------------------------------------------------------------------------- overview
def overview_page(data: Overview, *, csrf: str) -> str:
    live = (
        f'<div id="live" data-refresh="{PREFIX}/?fragment=1" data-refresh-s="{REFRESH_S}">'
        f"{overview_fragment(data)}</div>"
        f'<noscript><p>JavaScript is off: <a href="{PREFIX}/">reload</a> to refresh.</p>'
        "</noscript>"
    )
    return page("Overview", live, path="/", csrf=csrf)


def overview_fragment(data: Overview) -> str:
    """The overview's live part (what the browser fetches every few seconds)."""
    return (
        f'<p class="updated">As of {when(data.at)}.</p><div class="grid">'
        + section("Relay", _relay(data), ident="relay")
        + section("Replication slot", _slot(data.slot, data.lag.error), ident="slot")
        + section("Slot gaps", _gaps(data.gaps.value, data.gaps.error), ident="gaps")
        + section("Group lag", _lag_summary(data.lag.value, data.lag.error), ident="lag")
        + section("Parking lot", _parked(data) + _reasons(data), ident="parked")
        + section("Last audit", _audit_summary(data.audit, data.last_console_audit), ident="audit")
        + section("Engine routes", _routes(data.routes, data.sink_state), ident="routes", wide=True)
        + "</div>"
    )


def _relay(data: Overview) -> str:
    r = data.relay
    state = f'<span class="{"ok" if r.ready else "bad"}">{esc(r.state)}</span>'
    return facts(
        [
            ("ready", "relay-ready", "yes" if r.ready else "no"),
            ("state", "relay-state", state),
            ("mode", "relay-mode", esc(r.mode.value)),
            ("reads", "", f"<code>{esc(r.url)}/readyz</code>"),
        ]
    )


def _slot(slot: SlotStatus | None, error: str | None) -> str:
    if slot is None:
        return unknown(error or "no slot status (CDC_PG_DSN unset?)")
    if not slot["exists"]:
        return (
            f'<p class="bad" data-field="slot-exists">slot {esc(slot["slot"])} does not exist</p>'
        )
    return facts(
        [
            ("slot", "slot-name", esc(slot["slot"])),
            ("active", "slot-active", "yes" if slot["active"] else "no"),
            ("held by", "", esc(slot["holder"])),
            ("wal_status", "slot-wal-status", esc(slot["wal_status"])),
            ("WAL retained", "slot-retained", esc(bytes_text(slot["retained_wal_bytes"]))),
            ("WAL not confirmed", "slot-wal-lag", esc(bytes_text(slot["wal_lag_bytes"]))),
            ("safe WAL size", "", esc(safe_size(slot))),
            ("failover / synced", "slot-failover", esc(_failover(slot))),
            ("oldest unconfirmed", "slot-lag-time", esc(age_text(slot["lag_time_s"]))),
            ("confirmed LSN", "slot-confirmed", esc(slot["confirmed_flush_lsn"])),
            ("history", "slot-history", esc(gap_line(slot["gap"]))),
        ]
    )


def _failover(slot: SlotStatus) -> str | None:
    """PostgreSQL 17+: the slot's ``failover`` and ``synced`` (None before 17)."""
    if slot["failover"] is None:
        return None
    return f"{'yes' if slot['failover'] else 'no'} / {'yes' if slot['synced'] else 'no'}"


def _gaps(gaps: list[HistoryRow] | None, error: str | None) -> str:
    if gaps is None:
        return unknown(error)
    count = f'<p>Open gaps: <strong data-field="gaps-open">{len(gaps)}</strong></p>'
    rows = [
        [esc(g.slot), esc(g.cause), when(g.detected_at), esc(g.detail)[:300]] for g in gaps[:20]
    ]
    if not gaps:
        return count
    return count + table("Open gaps", ["slot", "cause", "detected", "detail"], rows)


def _lag_summary(lag: PipelineLag | None, error: str | None) -> str:
    if lag is None:
        return unknown(error)
    said = list(lag.problems)
    if lag.kafka_error is not None and lag.kafka_error not in said:
        said.insert(0, lag.kafka_error)
    problems = "".join(f'<li class="error">{esc(p)}</li>' for p in said)
    if lag.kafka_error is not None:
        total = "unknown"
        age = "unknown"
    else:
        totals = lag.totals
        total = str(totals.lag)
        age = age_text(totals.oldest_unprocessed_age_s)
    return facts(
        [
            ("group", "lag-group", esc(lag.group)),
            ("records behind", "lag-total", esc(total)),
            ("oldest unprocessed", "lag-oldest-age", esc(age)),
            (
                "partitions lagging",
                "lag-partitions",
                esc(f"{lag.totals.lagging_partitions} of {lag.totals.partitions}"),
            ),
        ]
    ) + (f"<ul>{problems}</ul>" if problems else "")


def _parked(data: Overview) -> str:
    if data.parked.value is None:
        return unknown(data.parked.error)
    rows = [
        [
            f'<a href="{PREFIX}/parking?{urlencode({"type": t, "status": "all"})}">{esc(t)}</a>',
            *(f'<span data-field="parked-{esc(t)}-{s}">{n}</span>' for s, n in counts.items()),
        ]
        for t, counts in data.parked_rows()
    ]
    return table(
        "Parked rows by sync type (UNROUTABLE: no route; others: the engine refused)",
        ["sync type", *STATUSES],
        rows,
        numeric=(1, 2, 3),
        empty="the parking lot is empty",
    )


def _reasons(data: Overview) -> str:
    """Open rows per reason class, the largest first (``outbox-cdc failed reasons``), each
    a link to the parking page listing that class's open rows."""
    if data.reasons.value is None:
        return unknown(data.reasons.error)
    rows = [
        [
            f'<a href="{PREFIX}/parking?{esc(urlencode({"reason_class": r.reason}))}"'
            f' data-field="reason-{i}">{esc(r.reason)}</a>'
            if r.reason  # (no reason written: no class to filter by)
            else f'<span data-field="reason-{i}">(no reason recorded)</span>',
            f'<span data-field="reason-{i}-count">{r.count}</span>',
        ]
        for i, r in enumerate(data.reasons.value)
    ]
    return table(
        f"Open parked rows by reason (the {REASONS_SHOWN} largest; outbox-cdc failed reasons)",
        ["reason", "open rows"],
        rows,
        numeric=(1,),
        empty="no open parked rows",
    )


def _routes(routes: Sequence[RouteView], sink_state: str) -> str:
    rows = [
        [
            f"<code>{esc(r.route)}</code>",
            esc(", ".join(r.types) or "\u2013"),
            '<span class="bad">open</span>' if r.circuit_open else '<span class="ok">closed</span>',
            esc(r.waiting),
        ]
        for r in routes
    ]
    state = facts([("sink", "sink-state", esc(sink_state))])
    return state + table(
        "Engine routes", ["route", "event types", "circuit", "waiting"], rows, numeric=(3,)
    )


def _audit_summary(audit: Readout[AuditMetricsView], last: Mapping[str, Any] | None) -> str:
    parts = []
    m = audit.value
    if m is None:
        parts.append(unknown(audit.error))
    else:
        runs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(m.runs.items()) if v) or "none yet"
        parts.append(
            facts(
                [
                    ("relay's periodic audits", "audit-runs", esc(runs)),
                    ("missing (last judged)", "audit-missing", esc(_num(m.missing))),
                    ("republished (total)", "", esc(_num(m.repaired))),
                ]
            )
        )
    if last is not None:
        parts.append(
            f'<p>Last run here: <a href="{PREFIX}/audit">{esc(last["run_id"])}</a>,'
            f' <strong data-field="audit-verdict">{esc(last["verdict"])}</strong>,'
            f" {esc(last['missing_count'])} missing.</p>"
        )
    return "".join(parts)


def _num(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}"


# -------------------------------------------------------------------------------- lag
def lag_page(
    lag: PipelineLag | None,
    error: str | None,
    rows: Sequence[PartitionLag],
    *,
    sort: str,
    descending: bool,
    history: LagHistory,
    csrf: str,
) -> str:
    if lag is None:
        return page("Lag", unknown(error), path="/lag", csrf=csrf)
    heads = []
    labels = {"topic": "topic", "partition": "partition", "committed": "committed"}
    labels |= {"end": "end", "lag": "lag", "age": "oldest age"}
    for key in LAG_SORT_KEYS:
        sorted_here = key == sort
        flip = "asc" if sorted_here and descending else "desc"
        aria = f' aria-sort="{"descending" if descending else "ascending"}"' if sorted_here else ""
        num = ' class="num"' if key != "topic" else ""
        heads.append(
            f'<th scope="col"{num}{aria}><a href="{PREFIX}/lag?sort={key}&amp;dir={flip}">'
            f"{labels[key]}</a></th>"
        )
    heads.append('<th scope="col">last minutes</th>')
    body = [_lag_row(p, history) for p in rows]
    summary = _lag_summary(lag, None)
    return page(
        "Lag",
        summary
        + table(
            f"Partitions of group {lag.group} (sorted by {sort})",
            [],
            body,
            numeric=(1, 2, 3, 4, 5),
            head_cells=heads,
            empty="no partitions (Kafka unreadable, or no topics)",
        ),
        path="/lag",
        csrf=csrf,
    )


def _lag_row(p: PartitionLag, history: LagHistory) -> list[str]:
    samples = history.series(p.topic, p.partition)
    points = sparkline(samples)
    if points:
        lags = [lag for _, lag in samples]
        label = (
            f"lag over the last {len(samples)} reads: from {lags[0]} to {lags[-1]},"
            f" at most {max(lags)}"
        )
        svg = (
            f'<svg class="spark" width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}"'
            f' viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" role="img" aria-label="{esc(label)}">'
            f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{points}"/>'
            "</svg>"
        )
    else:
        svg = '<span class="muted">one read so far</span>'
    committed = "never" if p.committed_offset is None else str(p.committed_offset)
    cell = f'data-field="lag-{esc(p.topic)}-{p.partition}"'
    return [
        esc(p.topic),
        esc(p.partition),
        esc(committed),
        esc(p.end_offset),
        f"<span {cell}>{p.lag}</span>",
        esc(age_text(p.oldest_unprocessed_age_s)),
        svg,
    ]


# ------------------------------------------------------------------------------ audit
def audit_page(
    audit: Readout[AuditMetricsView],
    last: Mapping[str, Any] | None,
    *,
    csrf: str,
    status: str = "",
) -> str:
    parts = []
    parts.append(section("The relay's periodic audit", _audit_summary(audit, None), ident="ra"))
    parts.append(section("Last audit run here", _audit_report(last), ident="last"))
    parts.append(
        section(
            "Run an audit",
            f'<form method="post" action="{PREFIX}/audit/run" class="filters">{csrf_field(csrf)}'
            '<div><label for="a-since">since (90m, 2h, 1d or ISO-8601; default: the'
            " configured window)</label>"
            '<input id="a-since" name="since" type="text"></div>'
            '<div class="check"><input id="a-repair" name="repair" type="checkbox" value="on">'
            '<label for="a-repair">repair: republish what is missing (asks to confirm)</label>'
            '</div><div><button type="submit">Run audit</button></div></form>',
            ident="run",
        )
    )
    return page("Audit", "".join(parts), path="/audit", csrf=csrf, status=status)


def _audit_report(last: Mapping[str, Any] | None) -> str:
    if last is None:
        return "<p>No audit run from this console yet.</p>"
    window = last.get("window") or {}
    info = facts(
        [
            ("run", "audit-run", f"<code>{esc(last.get('run_id'))}</code>"),
            ("verdict", "audit-verdict", f"<strong>{esc(last.get('verdict'))}</strong>"),
            ("window", "audit-window", esc(f"{window.get('since')} .. {window.get('until')}")),
            ("rows judged", "audit-rows", esc(last.get("table_rows"))),
            ("in Kafka", "", esc(last.get("in_kafka"))),
            ("in flight", "", esc(last.get("in_flight"))),
            ("missing", "audit-missing-count", esc(last.get("missing_count"))),
            ("repair", "", "on" if last.get("repair") else "off"),
            ("republished", "audit-repaired", esc(last.get("repaired"))),
            ("cannot judge", "", esc(last.get("cannot_judge"))),
        ]
    )
    missing = table(
        "Missing ids (first 200)",
        ["id", "aggregate type", "aggregate id", "created"],
        [
            [
                f'<a href="{PREFIX}/trace?{urlencode({"id": str(m.get("id"))})}"><code>'
                f"{esc(m.get('id'))}</code></a>",
                esc(m.get("aggregatetype")),
                esc(m.get("aggregateid")),
                esc(m.get("created_at")),
            ]
            for m in last.get("missing", [])
        ],
        empty="nothing missing",
    )
    notes = "".join(f"<li>{esc(n)}</li>" for n in last.get("notes", []))
    return info + missing + (f"<ul>{notes}</ul>" if notes else "")


def confirm_repair_page(since: str, *, csrf: str) -> str:
    body = (
        "<p>A repair republishes every outbox row of the window that is missing from Kafka"
        " (through the relay's router, header <code>recovered=audit-&lt;run&gt;</code>);"
        " consumers deduplicate on the <code>id</code> header.</p>"
        f'<form method="post" action="{PREFIX}/audit/run">{csrf_field(csrf)}'
        f'<input type="hidden" name="since" value="{esc(since)}">'
        '<input type="hidden" name="repair" value="on">'
        '<input type="hidden" name="confirm" value="yes">'
        '<button type="submit">Yes, audit and repair</button></form>'
        f'<p><a href="{PREFIX}/audit">No, back</a></p>'
    )
    return page("Confirm the repair", body, path="/audit", csrf=csrf)
