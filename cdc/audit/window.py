"""The audit's window: ``[since, until)`` in whole milliseconds, and how it is written. Pure.

Guarantees:

* a window is half-open and on millisecond boundaries, the resolution of a Kafka
  record's timestamp: a row whose time is in the window (commit time, truncated
  to the millisecond as the relay writes the record's timestamp) and its record
  are judged by the same bounds;
* :func:`parse_when` reads ``--since``/``--until``: a duration back from ``now``
  (``90s``, ``15m``, ``2h``, ``1d``, ``1h30m``) or an ISO-8601 time (a time
  without offset is UTC); anything else raises :class:`WindowError` naming the
  option and the accepted forms;
* :func:`window_for` gives the default: ending ``settle_s`` ago, ``width_s`` wide;
* :func:`from_first_start` moves a window's start to the relay's first start when it
  began before it (the rows committed before a ``slot init --from now`` or an
  empty-outbox first start were never the relay's to publish: the start-up check
  never judges them either); a window that ends at or before it raises
  :class:`BeforeFirstStartError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cdc.errors import CdcError

_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")
_UNIT_S = (86_400, 3_600, 60, 1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class WindowError(CdcError):
    """A window option is not a duration nor a time, or the window is empty."""


class BeforeFirstStartError(WindowError):
    """The whole window is before the relay's first start: nothing in it was its to publish."""


def to_ms(when: datetime) -> int:
    """Unix milliseconds of ``when``, truncated (as a record's timestamp is)."""
    return (when - _EPOCH) // timedelta(milliseconds=1)


def from_ms(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)


@dataclass(frozen=True)
class Window:
    """``[since_ms, until_ms)`` in Unix milliseconds."""

    since_ms: int
    until_ms: int

    def __post_init__(self) -> None:
        if self.until_ms <= self.since_ms:
            raise WindowError(
                f"the window is empty: --since {from_ms(self.since_ms).isoformat()} is not"
                f" before --until {from_ms(self.until_ms).isoformat()}"
            )

    @classmethod
    def between(cls, since: datetime, until: datetime) -> Window:
        return cls(to_ms(since), to_ms(until))

    @property
    def since(self) -> datetime:
        return from_ms(self.since_ms)

    @property
    def until(self) -> datetime:
        return from_ms(self.until_ms)

    @property
    def width_s(self) -> float:
        return (self.until_ms - self.since_ms) / 1000

    def as_json(self) -> dict[str, str]:
        return {"since": iso(self.since), "until": iso(self.until)}


def iso(when: datetime) -> str:
    """``2026-01-01T10:00:00.123Z``: UTC, milliseconds."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_duration_s(text: str) -> float | None:
    """Seconds of ``90s``, ``15m``, ``2h``, ``1d``, ``1h30m`` (``None``: not a duration)."""
    match = _DURATION_RE.match(text.strip().lower())
    if match is None or not any(match.groups()):
        return None
    return sum(
        float(part) * unit for part, unit in zip(match.groups(), _UNIT_S, strict=True) if part
    )


def parse_when(text: str, *, now: datetime, option: str) -> datetime:
    """A duration back from ``now``, or an ISO-8601 time (UTC when it has no offset)."""
    seconds = parse_duration_s(text)
    if seconds is not None:
        return now - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise WindowError(
            f"{option} {text!r}: expected a duration back from now (90s, 15m, 2h, 1d, 1h30m)"
            " or an ISO-8601 time (2026-01-01T10:00:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def window_for(
    *,
    now: datetime,
    settle_s: float,
    width_s: float,
    since: str | None = None,
    until: str | None = None,
) -> Window:
    """The window of ``--since``/``--until``; by default ``width_s`` ending ``settle_s`` ago."""
    end = (
        parse_when(until, now=now, option="--until") if until else now - timedelta(seconds=settle_s)
    )
    start = (
        parse_when(since, now=now, option="--since") if since else end - timedelta(seconds=width_s)
    )
    return Window.between(start, end)


def from_first_start(window: Window, first_start: datetime | None, *, slot: str) -> Window:
    """``window``, starting no earlier than ``first_start`` (None: no such boundary);
    :class:`BeforeFirstStartError` when it ends at or before it."""
    if first_start is None or window.since_ms >= to_ms(first_start):
        return window
    if window.until_ms <= to_ms(first_start):
        raise BeforeFirstStartError(
            f"the window {iso(window.since)} .. {iso(window.until)} ends before slot {slot}'s"
            f" first start at {iso(first_start)}: the rows committed before it were not"
            " published by choice (`slot init --from now`, or an empty outbox then)"
        )
    return Window(to_ms(first_start), window.until_ms)
