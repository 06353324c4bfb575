"""Rendering of the command line: the consoles, JSON, progress bars, the shared formats.

Answers go to stdout: a rich table for people, or with ``--json`` one JSON
document for scripts. Progress bars, warnings and errors go to stderr, so
``--json`` output always parses. The formats here (ages, sizes, offsets) are
the ones every command shows; the views of the kernel's answers (the
replication slot) are here too. rich is imported inside each function so
``outbox-cdc --help`` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from cdc.check import Finding
    from cdc.migrate import MigrationState
    from cdc.ops import SlotStatus


def out() -> Console:
    """The console of answers (stdout)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def err() -> Console:
    """The console of progress and warnings (stderr)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def echo_json(value: object) -> None:
    """One JSON document on stdout."""
    click.echo(json.dumps(value, indent=2, default=str))


def warn(lines: Sequence[str]) -> None:
    """One ``warning:`` line on stderr for each of ``lines``."""
    for line in lines:
        click.echo(f"warning: {line}", err=True)


def fmt_time(moment: datetime | None) -> str:
    """A moment in UTC, to the second, its zone said (``2026-12-01 06:00:00Z``); ``-`` for None."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_age(seconds: float | None) -> str:
    """``None`` -> ``?``; 0.4 -> ``0.4s``; 75 -> ``1m15s``; 7300 -> ``2h01m``; 1d01h."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def fmt_bytes(count: int | None) -> str:
    """``None`` -> ``?``; 512 -> ``512 B``; 1536 -> ``1.5 KiB``."""
    if count is None:
        return "?"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fmt_offset(offset: int | None) -> str:
    """A committed offset, ``-`` for a group that never committed."""
    return "-" if offset is None else str(offset)


def fmt_resume(offset: int | None, *, out_of_range: bool) -> str:
    """Where the consumer resumes; ``!`` marks a commit out of range, ``error`` no resume."""
    text = "error" if offset is None else str(offset)
    return f"{text} !" if out_of_range else text


@contextmanager
def progress_bar(*, enabled: bool = True) -> Iterator[Progress]:
    """A transient rich progress display on stderr."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err(),
        transient=True,
        disable=not enabled,
    )
    with bar:
        yield bar


# --- the replication slot ---------------------------------------------------------------------


def slot_line(slot: SlotStatus) -> str:
    """The slot in one line (``lag`` shows it under the consumer group)."""
    if not slot["exists"]:
        return f"slot {slot['slot']}: does not exist"
    holder = slot.get("holder") or f"walsender {slot['active_pid']}"
    state = f"active ({holder})" if slot["active"] else "inactive"
    return (
        f"slot {slot['slot']}: {state}, WAL lag {fmt_bytes(slot['wal_lag_bytes'])},"
        f" lag time {fmt_age(slot['lag_time_s'])}, confirmed {slot['confirmed_flush_lsn']}"
    )


def slot_table(status: SlotStatus) -> Any:
    """``slot status``: every field of the slot, one row each."""
    from rich.table import Table

    table = Table(
        title=f"replication slot {status['slot']}", title_justify="left", show_header=False
    )
    table.add_column("field")
    table.add_column("value")
    shown = {
        "plugin": status["plugin"],
        "active": f"yes, {status['holder'] or 'walsender ' + str(status['active_pid'])}"
        if status["active"]
        else "no",
        "confirmed flush LSN": status["confirmed_flush_lsn"],
        "restart LSN": status["restart_lsn"],
        "current WAL LSN": status["current_wal_lsn"],
        "WAL lag": fmt_bytes(status["wal_lag_bytes"]),
        "retained WAL": fmt_bytes(status["retained_wal_bytes"]),
        "WAL status": status["wal_status"],
        "safe WAL size": safe_size(status),
        "failover / synced": None
        if status["failover"] is None
        else f"{'yes' if status['failover'] else 'no'} / {'yes' if status['synced'] else 'no'}",
        "gap": gap_line(status["gap"]),
        "lag time": fmt_age(status["lag_time_s"]),
        "oldest unconfirmed commit": status["oldest_unconfirmed_commit_ts"],
        "note": status["lag_time_note"],
    }
    for name, value in shown.items():
        table.add_row(name, "-" if value is None else str(value))
    return table


def safe_size(status: SlotStatus) -> str | None:
    """WAL left before max_slot_wal_keep_size invalidates the slot (``no limit`` at -1)."""
    if not status["exists"]:
        return None
    size = status["safe_wal_size_bytes"]
    return "no limit (max_slot_wal_keep_size = -1)" if size is None else fmt_bytes(size)


def gap_line(row: dict[str, object] | None) -> str | None:
    """The slot's latest history row in one line (``slot status``)."""
    if row is None:
        return None
    if row["event"] == "created":
        return f"none (slot created {row['detected_at']} at a first start)"
    head = f"{row['id']} {row['state']}: {row['cause']} (found {row['detected_at']})"
    window = f" window {row['window_start'] or 'first row'} .. {row['window_end'] or 'now'}"
    if row["state"] == "recovered":
        return f"{head};{window}; {row['rows_recovered']} rows in {row['seconds']:.1f}s"
    if row["state"] == "accepted":
        return f"{head};{window}; loss accepted by {row['accepted_by']}"
    return f"{head}: {row['detail']}"


def drop_warning(status: SlotStatus, pending: int | None) -> str:
    """What ``slot drop`` loses, shown before it asks."""
    count = "an unknown number of" if pending is None else str(pending)
    return (
        f"[bold]slot {status['slot']}[/bold] confirmed {status['confirmed_flush_lsn']};"
        f" {fmt_bytes(status['wal_lag_bytes'])} of WAL after it hold {count} outbox event(s)."
        " Dropping the slot loses those not yet produced to Kafka: a new slot starts at the"
        " current WAL position. Rebuild the engine afterwards with `outbox-cdc resync users`."
    )


def migration_table(states: Sequence[MigrationState]) -> Any:
    """``migrate --status``: one row per migration, applied or pending."""
    from rich.table import Table

    pending = sum(1 for s in states if s.applied_at is None)
    table = Table(title=f"{len(states) - pending} applied, {pending} pending", title_justify="left")
    for name in ("version", "file", "part", "applied at"):
        table.add_column(name, overflow="fold")
    for s in states:
        table.add_row(
            s.version,
            s.name,
            s.part.value if s.part else "(no such file here)",
            s.applied_at or "pending",
        )
    return table


def check_table(findings: Sequence[Finding]) -> Any:
    """``check``: one row per item, its verdict coloured, the detail folded (never cut)."""
    from rich.table import Table

    colours = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    failing = sum(1 for f in findings if f.status.value == "fail")
    table = Table(
        title=f"outbox-cdc check: {'all ok' if not failing else f'{failing} failing'}",
        title_justify="left",
    )
    table.add_column("item", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for f in findings:
        table.add_row(f.item, f"[{colours[f.status.value]}]{f.status.value}[/]", f.detail)
    return table
