"""The console's pages of single events: the parking lot (list, filters, detail, actions)
and the trace of an event or a key.

Guarantees: every action is a ``<form method="post">`` carrying the session's CSRF
token (the retry and the discard of a selection or of one row); every value from the
pipeline is escaped (:func:`~sinks.console.layout.esc`); every input has a label.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence

from sinks.console.layout import (
    ERROR_CELL_CHARS,
    PREFIX,
    csrf_field,
    esc,
    facts,
    page,
    section,
    table,
    unknown,
    when,
)
from sinks.console.views import STATUSES, ParkedFilter
from sinks.parking.lot import ParkedEvent
from sinks.parking.retrier import RetrySummary
from sinks.trace.model import EventTrace


# ---------------------------------------------------------------------------- parking
def _filter_form(f: ParkedFilter) -> str:
    q = f.query
    status = q.get("status", "open")
    options = "".join(
        f'<option value="{s}"{" selected" if s == status else ""}>{s}</option>'
        for s in ("open", "all", *STATUSES)
    )

    def field(name: str, label: str, kind: str = "text") -> str:
        return (
            f'<div><label for="f-{name}">{label}</label>'
            f'<input id="f-{name}" name="{name}" type="{kind}" value="{esc(q.get(name, ""))}">'
            "</div>"
        )

    return (
        f'<form method="get" action="{PREFIX}/parking" class="filters" role="search"'
        ' aria-label="Filter parked rows">'
        f'<div><label for="f-status">status</label><select id="f-status" name="status">'
        f"{options}</select></div>"
        + field("type", "type (sync type or record type)")
        + field("reason", "reason (text in the last error)")
        + field("reason_class", "reason class (as the overview counts)")
        + field("key", "key")
        + field("since", "parked since", "datetime-local")
        + field("until", "parked before", "datetime-local")
        + '<div><button type="submit">Filter</button></div></form>'
    )


def parking_page(
    rows: Sequence[ParkedEvent] | None,
    error: str | None,
    f: ParkedFilter,
    *,
    csrf: str,
    status: str = "",
) -> str:
    parts = [_filter_form(f)]
    if rows is None:
        parts.append(unknown(error))
        return page("Parking lot", "".join(parts), path="/parking", csrf=csrf, status=status)
    body = [_parked_row(r) for r in rows]
    heads = [
        '<th scope="col"><span class="visually-hidden">select</span></th>',
        *(
            f'<th scope="col">{h}</th>'
            for h in (
                "row",
                "sync type",
                "type",
                "key",
                "status",
                "attempts",
                "last error",
                "parked",
            )
        ),
    ]
    listing = table(
        f"{len(rows)} parked rows (oldest first, at most 100)",
        [],
        body,
        numeric=(1, 6),
        head_cells=heads,
        empty="no parked row matches",
    )
    parts.append(
        f'<form method="post" action="{PREFIX}/parking/retry" id="rows">{csrf_field(csrf)}'
        f"{listing}"
        '<div class="actions"><button type="submit">Retry selected</button>'
        '<label for="reason">reason to discard</label>'
        '<input id="reason" name="reason" type="text" maxlength="500">'
        f'<button type="submit" formaction="{PREFIX}/parking/discard">Discard selected</button>'
        "</div></form>"
    )
    return page("Parking lot", "".join(parts), path="/parking", csrf=csrf, status=status)


def _parked_row(r: ParkedEvent) -> list[str]:
    box = (
        f'<input type="checkbox" name="id" value="{r.event_id}" id="sel-{r.event_id}"'
        f' aria-label="select row {r.event_id}">'
    )
    error = (r.last_error or "")[:ERROR_CELL_CHARS]
    return [
        box,
        f'<a href="{PREFIX}/parking/{r.event_id}">{r.event_id}</a>',
        esc(r.event_type),
        esc(r.type_header or None),
        f"<code>{esc(r.kafka_key)}</code>",
        esc(r.status),
        esc(r.retry_count),
        esc(error or None),
        when(r.created_at),
    ]


def parked_detail_page(row: ParkedEvent, *, csrf: str, status: str = "") -> str:
    payload = row.payload_json
    with contextlib.suppress(ValueError):  # not JSON: shown as stored
        payload = json.dumps(json.loads(payload), indent=2, ensure_ascii=False)
    where = (
        f"{row.kafka_topic}[{row.kafka_partition}]@{row.kafka_offset}" if row.kafka_topic else None
    )
    info = facts(
        [
            ("row", "parked-id", esc(row.event_id)),
            ("status", "parked-status", esc(row.status)),
            ("sync type", "", esc(row.event_type)),
            ("event id", "parked-event-id", f"<code>{esc(row.outbox_event_id)}</code>"),
            ("Kafka record", "", esc(where)),
            ("key", "", f"<code>{esc(row.kafka_key)}</code>"),
            ("attempts", "parked-attempts", esc(row.retry_count)),
            ("last engine answer", "parked-error", esc(row.last_error)),
            ("next retry", "", when(row.next_retry_at)),
            ("parked", "", when(row.created_at)),
            ("updated", "", when(row.updated_at)),
        ]
    )
    headers = table(
        "Headers",
        ["header", "value"],
        [[esc(k), f"<code>{esc(v)}</code>"] for k, v in sorted(row.kafka_headers.items())],
    )
    actions = ""
    if row.status != "DONE":
        actions = (
            f'<form method="post" action="{PREFIX}/parking/retry" class="actions">'
            f'{csrf_field(csrf)}<input type="hidden" name="id" value="{row.event_id}">'
            f'<input type="hidden" name="back" value="detail">'
            '<button type="submit">Retry now</button>'
            '<label for="reason">reason to discard</label>'
            '<input id="reason" name="reason" type="text" maxlength="500">'
            f'<button type="submit" formaction="{PREFIX}/parking/discard">Discard</button></form>'
        )
    body = (
        info
        + section("Payload", f'<pre tabindex="0">{esc(payload)}</pre>', ident="payload")
        + headers
        + actions
    )
    return page(f"Parked row {row.event_id}", body, path="/parking", csrf=csrf, status=status)


def retry_status(summary: RetrySummary, message: str) -> str:
    d = summary.as_data()
    return esc(
        f"retried: {d['processed_count']} processed, {d['done_count']} delivered,"
        f" {d['failed_count']} still failing. {message}"
    )


# ------------------------------------------------------------------------------ trace
def trace_page(
    found: Sequence[EventTrace] | None,
    error: str | None,
    params: Mapping[str, str],
    *,
    csrf: str,
) -> str:
    form = (
        f'<form method="get" action="{PREFIX}/trace" class="filters" role="search"'
        ' aria-label="Trace an event">'
        '<div><label for="t-id">event id</label>'
        f'<input id="t-id" name="id" type="text" value="{esc(params.get("id", ""))}"'
        ' placeholder="uuid"></div>'
        '<div><label for="t-key">or every event of key</label>'
        f'<input id="t-key" name="key" type="text" value="{esc(params.get("key", ""))}"></div>'
        '<div><button type="submit">Trace</button></div></form>'
    )
    parts = [form]
    if error is not None:
        parts.append(f'<p class="error" role="alert">{esc(error)}</p>')
    for item in found or ():
        parts.append(_trace(item))
    return page("Trace", "".join(parts), path="/trace", csrf=csrf)


def _trace(t: EventTrace) -> str:
    row = t.outbox
    record = t.record
    outbox = (
        f"{row.aggregate_type}/{row.aggregate_id} {row.event_type}, created {row.created_at}"
        if row
        else "gone (pruned, or deleted in its transaction) or never there"
    )
    kafka = (
        f"{record.topic} partition {record.partition} offset {record.offset}"
        if record
        else f"not found ({t.bounds.scanned} records read)"
    )
    parked = t.parked
    info = facts(
        [
            ("state", "trace-state", f"<strong>{esc(t.state.value)}</strong>"),
            ("verdict", "trace-summary", esc(t.summary)),
            ("outbox row", "trace-outbox", esc(outbox)),
            ("commit", "", esc(f"LSN {t.commit_lsn or '?'} at {t.commit_ts or '?'}")),
            ("Kafka record", "trace-kafka", esc(kafka)),
            (
                "parking lot",
                "trace-parked",
                f'<a href="{PREFIX}/parking/{parked.id}">row {parked.id}</a>: '
                f"{esc(parked.status)}, {parked.retry_count} attempts, {esc(parked.last_error)}"
                if parked
                else "not parked",
            ),
        ]
    )
    groups = table(
        "Consumer groups on that partition",
        ["group", "committed", "position", "records before it"],
        [
            [
                esc(g.group + (" (sink)" if g.group == t.sink_group else "")),
                esc(g.committed),
                esc(g.position.value),
                esc(g.records_before),
            ]
            for g in t.groups
        ],
        numeric=(1, 3),
    )
    headers = ""
    if record is not None:
        headers = table(
            "Record headers",
            ["header", "value"],
            [[esc(k), f"<code>{esc(v)}</code>"] for k, v in sorted(record.headers.items())],
        )
    return (
        f'<article class="trace" aria-labelledby="ev-{esc(t.event_id)}">'
        f'<h2 id="ev-{esc(t.event_id)}">Event <code>{esc(t.event_id)}</code></h2>'
        f"{info}{groups}{headers}</article>"
    )
