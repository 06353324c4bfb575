"""Whether each standby carries the relay's failover slot for good: one look, two readers.

On PostgreSQL 17+ a standby set up for it (``sync_replication_slots``) keeps a copy of a
failover slot. Right after the slot is made the copy is *temporary*: the standby keeps
it only until the slot's catalog xmin passes its own (26 s measured after a relay's
first start); a failover meanwhile finds no slot on the new primary and goes through
gap recovery (duplicates, nothing lost). Only a copy that is ``synced`` and not
``temporary`` survives a promotion: the slot is then carried *for good*.

That state shows only on the standby (its own ``pg_replication_slots``), so it is read
there, on each host of a multi-host ``CDC_PG_DSN`` that is in recovery.

Guarantees:

* one source: ``outbox-cdc check`` (:mod:`cdc.check`, its ``standby <host:port>``
  items) and the relay's ``/readyz`` lines and ``outbox_relay_failover_slot_synced``
  gauge (:mod:`cdc.relay.standby.watch`) both read :func:`look_at_standbys`, and
  :func:`classify` is the one answer to "for good, not yet, missing or unknown";
* a look is bounded: each host is read with one query within ``timeout_s``,
  connecting included (:func:`cdc.pgconn.rows_within`), at most
  :data:`MAX_STANDBY_HOSTS` hosts; a host that does not answer in time is
  :attr:`Carry.UNKNOWN` with why, never "ok", never a hang;
* it only reads; a host that is not in recovery (the primary) is skipped; the
  hosts come from the DSN, never from the server (so a gauge's labels are bounded
  by the operator's own list).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.pgconn import Use, failure_text, rows_within

#: Hosts of a multi-host DSN looked at: an operator lists a primary and a few standbys;
#: past this the rest are not looked at (a bound on a look's time and on label values).
MAX_STANDBY_HOSTS = 8
#: Longest text of a failure kept in a phrase (libpq's messages run to several lines).
WHY_MAX_CHARS = 160

#: One read on the host: in recovery?, its settings for slot sync, its copy of the slot.
#: ``pg_settings`` leaves out ``primary_conninfo`` for a role that may not read it (NULL:
#: not checked); ``to_jsonb`` reads ``synced``/``temporary`` on any version (NULL: none).
STANDBY_SQL = """
SELECT pg_is_in_recovery(),
       (SELECT setting FROM pg_settings WHERE name = 'sync_replication_slots'),
       (SELECT setting FROM pg_settings WHERE name = 'hot_standby_feedback'),
       (SELECT setting FROM pg_settings WHERE name = 'primary_conninfo'),
       s.found IS NOT NULL, s.row ->> 'synced', s.row ->> 'temporary'
FROM (SELECT 1) AS one
LEFT JOIN (SELECT true AS found, to_jsonb(r) AS row FROM pg_replication_slots r
           WHERE r.slot_name = $1) AS s ON true
"""


class Carry(enum.Enum):
    """Whether a standby carries the failover slot through a promotion."""

    FOR_GOOD = "for good"  # a synced copy, not temporary: a failover keeps the slot
    NOT_YET = "not yet"  # a synced copy, still temporary: a failover now is a gap recovery
    MISSING = "missing"  # no synchronized copy: a failover now is a gap recovery
    UNKNOWN = "unknown"  # the relay could not look (why is said beside it)


#: ``outbox_relay_failover_slot_synced``'s value per answer.
GAUGE_VALUE = {Carry.FOR_GOOD: 1.0, Carry.NOT_YET: 0.0, Carry.MISSING: 0.0, Carry.UNKNOWN: -1.0}


class SlotCopyRow(NamedTuple):
    """The standby's row of the slot, as read there (None: the column is not there)."""

    synced: bool | None
    temporary: bool | None


def classify(row: SlotCopyRow | None) -> tuple[Carry, str]:
    """The answer for a standby's row of the slot (None: no such row), and why."""
    if row is None:
        return Carry.MISSING, "no synchronized copy"
    if row.synced is None:
        return Carry.UNKNOWN, "the standby shows no synced column (PostgreSQL before 17)"
    if not row.synced:
        return Carry.MISSING, "a slot of that name the standby made itself, not a copy"
    if row.temporary is None:
        return Carry.UNKNOWN, "the standby shows no temporary column"
    if row.temporary:
        return Carry.NOT_YET, "temporary copy"
    return Carry.FOR_GOOD, "synced, not temporary"


def standby_fixes(sync: str | None, feedback: str | None, conninfo: str | None) -> tuple[str, ...]:
    """What the standby's own settings lack to keep a copy (empty: nothing);
    ``conninfo`` None: not readable by this role, not checked."""
    fixes = [
        f"{name} = on"
        for name, value in (("sync_replication_slots", sync), ("hot_standby_feedback", feedback))
        if value != "on"
    ]
    if conninfo is not None and "dbname" not in conninfo:
        fixes.append("a dbname in primary_conninfo")
    return tuple(fixes)


@dataclass(frozen=True)
class StandbyCopy:
    """One standby host's answer."""

    where: str  # host:port, as CDC_PG_DSN names it
    carry: Carry
    why: str  # classify's reason, or why the relay could not look
    fixes: tuple[str, ...] = ()  # the standby's settings that keep it from carrying

    @property
    def phrase(self) -> str:
        """The /readyz line: ``standby <where>: failover slot not yet carried for good
        (temporary copy)``."""
        head = f"standby {self.where}: failover slot"
        tail = f"; not set up to keep it: set {'; '.join(self.fixes)}" if self.fixes else ""
        if self.carry is Carry.FOR_GOOD:
            return f"{head} carried for good ({self.why}){tail}"
        if self.carry is Carry.NOT_YET:
            return f"{head} not yet carried for good ({self.why}){tail}"
        if self.carry is Carry.MISSING:
            return f"{head} not carried ({self.why}){tail}"
        return f"{head} unknown ({self.why})"


#: The /readyz line when CDC_PG_DSN names one host: no standby to read.
ONE_HOST_NOTE = (
    "standbys: failover slot unknown (CDC_PG_DSN names one host, so the relay cannot read"
    " a standby's copy: list the standbys' hosts in it)"
)
#: The /readyz line when no other host of a multi-host CDC_PG_DSN is in recovery.
NO_STANDBY_NOTE = (
    "standbys: failover slot unknown (no host of CDC_PG_DSN but the primary is a standby now)"
)


def readiness_notes(copies: Sequence[StandbyCopy], *, hosts: int) -> tuple[str, ...]:
    """The /readyz lines for ``copies`` read on a DSN of ``hosts`` hosts: one per
    standby, else why none could be read (never nothing: unknown is said)."""
    if hosts < 2:  # a primary and at least one other
        return (ONE_HOST_NOTE,)
    if not copies:
        return (NO_STANDBY_NOTE,)
    return tuple(copy.phrase for copy in copies)


def dsn_hosts(dsn: str) -> list[tuple[str, str, str]]:
    """(where, host, port) of each host ``dsn`` names (libpq's ``host``/``port`` lists:
    one port for all, or one each), at most :data:`MAX_STANDBY_HOSTS`."""
    params = conninfo_to_dict(dsn)
    hosts = str(params.get("host") or params.get("hostaddr") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    out = []
    for i, host in enumerate(hosts[:MAX_STANDBY_HOSTS]):
        port = ports[i] if len(ports) == len(hosts) else ports[0]
        out.append((f"{host}:{port}" if port else host, host, port))
    return out


def _host_dsn(dsn: str, index: int, port: str) -> str:
    """``dsn`` narrowed to its ``index``-th host, any role (the look asks itself)."""
    params = conninfo_to_dict(dsn)
    for many in ("host", "hostaddr"):
        if params.get(many):
            values = str(params[many]).split(",")
            params[many] = values[index] if index < len(values) else values[0]
    if port:
        params["port"] = port
    params.pop("load_balance_hosts", None)
    params["target_session_attrs"] = "any"
    return make_conninfo("", **params)


def look_at_standbys(
    dsn: str, slot: str, *, timeout_s: float, use: Use = Use.QUERY
) -> list[StandbyCopy]:
    """Each standby host of ``dsn``: does it carry ``slot`` for good? (Empty: ``dsn``
    names one host.) Every host is read within ``timeout_s``, on a connection of
    ``use`` (the preflight's: :attr:`Use.CLI`); the primary is skipped."""
    hosts = dsn_hosts(dsn)
    if len(hosts) < 2:  # a primary and at least one other
        return []
    copies = []
    for index, (where, _host, port) in enumerate(hosts):
        copy = _look_at(_host_dsn(dsn, index, port), where, slot, timeout_s, use)
        if copy is not None:
            copies.append(copy)
    return copies


def _look_at(dsn: str, where: str, slot: str, timeout_s: float, use: Use) -> StandbyCopy | None:
    """One host's answer (None: it is not in recovery - the primary, not a standby)."""
    try:
        rows = rows_within(dsn, STANDBY_SQL, [slot], timeout_s, use=use)
    except psycopg.Error as exc:
        return StandbyCopy(where, Carry.UNKNOWN, f"cannot look: {_short(exc)}")
    if not rows:
        return StandbyCopy(where, Carry.UNKNOWN, "cannot look: no answer")
    return copy_of(where, rows[0])


def copy_of(where: str, row: Sequence[str | None]) -> StandbyCopy | None:
    """A :data:`STANDBY_SQL` row (text values) as the host's answer (None: the primary)."""
    in_recovery, sync, feedback, conninfo, found, synced, temporary = row
    if in_recovery != "t":
        return None
    copy = SlotCopyRow(_flag(synced), _flag(temporary)) if found == "t" else None
    carry, why = classify(copy)
    return StandbyCopy(where, carry, why, standby_fixes(sync, feedback, conninfo))


def _flag(text: str | None) -> bool | None:
    return None if text is None else text in ("t", "true")


def _short(exc: BaseException) -> str:
    """A failure's first line, bounded (never the DSN: psycopg's messages hold none)."""
    lines = failure_text(exc).splitlines()
    text = lines[0].strip() if lines else type(exc).__name__
    return text if len(text) <= WHY_MAX_CHARS else text[: WHY_MAX_CHARS - 1] + "…"
