"""Why rows are parked, by class: the reason-class SQL the parking lot counts and filters
by (:meth:`sinks.parking.lot.ParkingLot.counts_by_reason`, ``list_rows(reason_class=)``),
read by ``outbox-cdc failed reasons`` and the console's overview (one source).

A row's ``last_error`` is free text (an engine's body, an exception's words, a record's
place); its class leaves that text out, so rows parked for one cause count together, and
PostgreSQL computes it, so the counts and the filter agree on every row.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Open rows' reasons the overview and ``outbox-cdc failed reasons`` show (most first).
REASONS_SHOWN = 10

#: The part of ``last_error`` a reason class is read from: its first part (before a
#: ``; ``: a stub's "payload not stored", a refused park's note), without the record's
#: position (``record ('topic', 0, 17): ``, an unreadable record) and without the event
#: type the routing puts first (``UserRegistered: payload has no user_id string``).
_REASON_HEAD = (
    "regexp_replace(regexp_replace(split_part(coalesce(last_error, ''), '; ', 1),"
    " '^record \\([^)]*\\): ', ''), '^[A-Za-z_][A-Za-z0-9_.]*: ', '')"
)
#: A row's reason class, as the sink writes reasons (sinks.core.statuses, sinks.core.machine,
#: sinks.shared.routes, sinks.parking.retrier): an engine's answer is its status
#: (``HTTP 400``, ``HTTP 404 user_not_found``, ``engine unavailable: HTTP 503``: no
#: body excerpt, no "(after 3 attempts)"); anything else is the head up to the first
#: ``: ``, `` (`` or ``, while `` (``unreadable record``, ``payload is not valid JSON``,
#: ``no event id``), at most 80 characters. Free text (a body, an exception's words, a
#: record's place) never splits a class; an empty reason is ``''``.
REASON_CLASS_SQL = (
    f"COALESCE(substring({_REASON_HEAD} from"
    " '^(?:engine unavailable: )?HTTP [0-9]{3}(?: user_not_found)?'),"
    f" left(btrim(regexp_replace({_REASON_HEAD}, '(: | \\(|, while ).*$', '')), 80))"
)


#: Open rows per reason class, the ``limit`` largest first (ties: by class).
REASONS_SQL = (
    f"SELECT {REASON_CLASS_SQL} AS reason, count(*) AS n"  # noqa: S608 - constants only
    " FROM failed_sync_events WHERE status <> 'DONE'"
    " GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT %(limit)s"
)


@dataclass(frozen=True, slots=True)
class ReasonCount:
    """Open rows (FAILED, PENDING) of one reason class (:data:`REASON_CLASS_SQL`)."""

    reason: str
    count: int
