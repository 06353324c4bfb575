"""Every PostgreSQL connection outbox-cdc opens, with its libpq parameters from one place.

Guarantees:

* every connection made through :func:`connect` (or whose DSN went through
  :func:`conninfo`) has a connect timeout, TCP keepalives and
  ``tcp_user_timeout`` on the client's side of the socket, and - as session
  settings, on every connection of the relay (not an operator's: :data:`Use.CLI`)
  - the same on the server's side (``tcp_keepalives_*``,
  ``tcp_user_timeout``): a dead path (a NAT that forgot the mapping, a cable
  pulled, a half-open TCP connection) is noticed by both ends within
  :data:`DEAD_PATH_S`, an idle path is kept alive (probes every
  :data:`KEEPALIVES_INTERVAL_S` after :data:`KEEPALIVES_IDLE_S` of quiet), and a
  server never keeps the backend of a vanished client (its locks, its
  walsender, the slot) for the kernel's two hours;
* the :class:`Use` of a connection bounds its waits: the relay's short queries
  end after :data:`STATEMENT_TIMEOUT_MS` and wait for a lock at most
  :data:`LOCK_TIMEOUT_MS`; work of unknown size (a recovery's window, a
  history write) waits for locks at most that long but may run; a connection
  that holds something while idle by design (the recovery's advisory lock, an
  exported snapshot) is exempt from ``idle_session_timeout`` and
  ``idle_in_transaction_session_timeout``;
* :func:`rows_within` answers one query within a deadline of its own, connecting
  included, whatever the path does (a peer that ACKs and never answers, a
  connect that hangs): the silence detector's look at a walsender;
* what the DSN says wins over every default: a libpq parameter it sets (or
  libpq's ``PGCONNECT_TIMEOUT`` / ``PGOPTIONS`` when it does not), and a
  ``-c name=value`` in its ``options`` over the same session setting of ours.

:func:`connect` is the only way ``cdc`` opens a PostgreSQL connection; the
numbers are constants with their reasons, below.
"""

from __future__ import annotations

import enum
import os
import re
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

Conn = psycopg.Connection[Any]

#: A connect that hangs (a server that accepts nothing, a black-holed route) fails
#: after this and the caller's retry starts over.
CONNECT_TIMEOUT_S = 10
#: An idle path is probed after this quiet: shorter than any NAT or firewall idle
#: timeout in use (the shortest common ones are 30-60 s), so the mapping never expires.
KEEPALIVES_IDLE_S = 10
#: Between probes of a path that did not answer the last one.
KEEPALIVES_INTERVAL_S = 5
#: Probes lost before the path is given up: 10 + 3 x 5 = 25 s for an idle path.
KEEPALIVES_COUNT = 3
#: Data sent and not acknowledged for this long fails the connection (keepalives
#: only cover an idle path; the relay sends a status update every second, so this is
#: what ends a replication connection behind a dropped path).
TCP_USER_TIMEOUT_MS = 30_000
#: The longest a dead path goes unnoticed by either end of a connection.
DEAD_PATH_S = max(
    KEEPALIVES_IDLE_S + KEEPALIVES_INTERVAL_S * KEEPALIVES_COUNT, TCP_USER_TIMEOUT_MS / 1000
)
#: The relay's own queries (catalog lookups, a slot's row, one history row) take
#: milliseconds; a minute only trips on a server that cannot answer, and the caller's
#: retry starts over.
STATEMENT_TIMEOUT_MS = 60_000
#: Longest wait for a lock (a DDL or a long transaction holding the outbox, the
#: publication or the history table): an error the caller retries, never a hang.
LOCK_TIMEOUT_MS = 30_000


class Use(enum.Enum):
    """What a connection is for: which of its waits are bounded, and how."""

    #: the relay's short reads and writes: statement and lock timeouts
    QUERY = "query"
    #: holds something while idle by design (the recovery's advisory lock): as QUERY,
    #: and exempt from the server's idle timeouts
    HOLD = "hold"
    #: work of unknown size (a recovery's window, an exported snapshot read): lock
    #: timeout, no statement timeout, exempt from the idle timeouts
    WORK = "work"
    #: a replication connection (the stream, IDENTIFY_SYSTEM, the exported snapshot's
    #: CREATE_REPLICATION_SLOT): exempt from the idle timeouts (statement timeouts do
    #: not apply to replication commands)
    REPLICATION = "replication"
    #: an operator's command (the CLI): keepalives only; its operations take what they take
    CLI = "cli"


#: libpq parameters of every connection unless its DSN sets them.
CLIENT_DEFAULTS: dict[str, str] = {
    "connect_timeout": str(CONNECT_TIMEOUT_S),
    "keepalives": "1",
    "keepalives_idle": str(KEEPALIVES_IDLE_S),
    "keepalives_interval": str(KEEPALIVES_INTERVAL_S),
    "keepalives_count": str(KEEPALIVES_COUNT),
    "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
}

#: libpq's environment variables that stand for a parameter the DSN leaves out.
_ENV_OF = {"connect_timeout": "PGCONNECT_TIMEOUT", "options": "PGOPTIONS"}

#: The server's side of the socket, as session settings (every use).
_SERVER_SOCKET = {
    "tcp_keepalives_idle": str(KEEPALIVES_IDLE_S),
    "tcp_keepalives_interval": str(KEEPALIVES_INTERVAL_S),
    "tcp_keepalives_count": str(KEEPALIVES_COUNT),
    "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
}
_NOT_IDLE = {"idle_session_timeout": "0", "idle_in_transaction_session_timeout": "0"}
_BOUNDED = {"statement_timeout": str(STATEMENT_TIMEOUT_MS), "lock_timeout": str(LOCK_TIMEOUT_MS)}

#: Session settings per use (before what the DSN's ``options`` says).
SESSION_SETTINGS: dict[Use, dict[str, str]] = {
    Use.QUERY: {**_SERVER_SOCKET, **_BOUNDED},
    Use.HOLD: {**_SERVER_SOCKET, **_BOUNDED, **_NOT_IDLE},
    Use.WORK: {**_SERVER_SOCKET, "lock_timeout": str(LOCK_TIMEOUT_MS), **_NOT_IDLE},
    Use.REPLICATION: {**_SERVER_SOCKET, **_NOT_IDLE},
    # (none: an operator's connection may go through a pooler that refuses ``options``)
    Use.CLI: {},
}


#: What a process says it is in its replication connections' ``application_name``
#: (``outbox-cdc relay`` by the relay's command; an ops command is ``outbox-cdc cli``).
PROCESS_ROLE = ["cli"]
#: PostgreSQL keeps this much of an application_name (NAMEDATALEN - 1 bytes).
APPLICATION_NAME_MAX = 63


def application_name() -> str:
    """``outbox-cdc <role> pid=<pid> host=<hostname>``: the holder of a slot is named by it
    (``slot drop``, a standby's wait), the process's PID and host beside the walsender's."""
    text = f"outbox-cdc {PROCESS_ROLE[0]} pid={os.getpid()} host={socket.gethostname()}"
    return text.encode()[:APPLICATION_NAME_MAX].decode(errors="ignore")


#: :func:`application_name`, read back.
_NAMED = re.compile(r"^outbox-cdc (\S+) pid=(\d+) host=(\S*)")


def describe_holder(application_name: str | None, client_hostname: str | None) -> str:
    """The process behind a connection, as far as the server shows it: ``relay pid 12053
    on host h`` (from :func:`application_name`), else its application_name and host."""
    found = _NAMED.match(application_name or "")
    if found:
        role, pid, host = found.groups()
        return f"{role} pid {pid} on host {host}"
    parts = [f"application_name {application_name!r}"] if application_name else []
    return ", ".join(parts + ([f"host {client_hostname}"] if client_hostname else []))


def conninfo(dsn: str, use: Use = Use.QUERY) -> str:
    """``dsn`` with the defaults of ``use`` merged in (see the module docstring); a
    replication connection also names its process (:func:`application_name`) unless the
    DSN or ``PGAPPNAME`` names one."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    for name, value in CLIENT_DEFAULTS.items():
        if name not in params and not os.environ.get(_ENV_OF.get(name, "")):
            params[name] = value
    named = "application_name" in params or os.environ.get("PGAPPNAME")
    if use is Use.REPLICATION and not named:
        params["application_name"] = application_name()
    ours = " ".join(f"-c {name}={value}" for name, value in SESSION_SETTINGS[use].items())
    if ours:
        theirs = params.get("options") or os.environ.get("PGOPTIONS", "")
        params["options"] = f"{ours} {theirs}".strip()  # (a later -c wins: theirs)
    return make_conninfo("", **params)


def connect(dsn: str, use: Use = Use.QUERY, **kwargs: Any) -> Conn:
    """``psycopg.connect`` with :func:`conninfo`'s defaults; autocommit unless told.

    ``kwargs`` are psycopg's (``replication``, ``row_factory``, ...); libpq
    parameters belong in the DSN, where the user's win.
    """
    kwargs.setdefault("autocommit", True)
    return psycopg.connect(conninfo(dsn, use), **kwargs)


def rows_within(
    dsn: str, query: str, params: Sequence[str], timeout_s: float, *, use: Use = Use.QUERY
) -> list[tuple[str | None, ...]]:
    """The rows (text values) of ``query`` (``$1``-style parameters, as text) on a new
    connection to ``dsn``, or :class:`psycopg.OperationalError` when connecting and
    answering take longer than ``timeout_s`` together (a connect that hangs, a peer
    that ACKs and never answers: no TCP timeout ends those); any other failure
    raises as psycopg does. The connection's own ``connect_timeout`` is the rest of
    the deadline (the DSN's when shorter); ``use`` its session settings."""
    deadline = time.monotonic() + timeout_s
    params_dict = conninfo_to_dict(dsn)
    theirs = params_dict.get("connect_timeout")
    limit = max(1, int(timeout_s))
    if theirs is None or not str(theirs).isdigit() or int(theirs) <= 0 or int(theirs) > limit:
        dsn = make_conninfo(dsn, connect_timeout=str(limit))
    with connect(dsn, use) as conn:
        pg = conn.pgconn
        pg.nonblocking = 1
        pg.send_query_params(query.encode(), [p.encode() for p in params])
        while pg.flush() != 0:
            _ready(pg.socket, deadline, write=True)
        pg.consume_input()
        while pg.is_busy():
            _ready(pg.socket, deadline, write=False)
            pg.consume_input()
        results = []
        while (result := pg.get_result()) is not None:
            results.append(result)
        rows: list[tuple[str | None, ...]] = []
        for result in results:
            if result.status != pq.ExecStatus.TUPLES_OK:
                message = (result.error_message or b"").decode(errors="replace").strip()
                raise psycopg.OperationalError(message or f"query failed: status {result.status}")
            for i in range(result.ntuples):
                rows.append(
                    tuple(
                        None if (v := result.get_value(i, j)) is None else bytes(v).decode()
                        for j in range(result.nfields)
                    )
                )
        return rows


def _ready(fd: int, deadline: float, *, write: bool) -> None:
    """Wait until ``fd`` is readable (writable), or raise at ``deadline``."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        ready = (
            select.select([], [fd], [], remaining)
            if write
            else select.select([fd], [], [], remaining)
        )
        if ready[0] or ready[1]:
            return
    raise psycopg.OperationalError("no answer from the server within the look's deadline")


def failure_text(exc: BaseException) -> str:
    """A connection error's text without psycopg's own leading ``connection failed:``,
    for a line that says so itself (``PostgreSQL connection failed: <this>``)."""
    text = str(exc).strip()
    for prefix in ("connection failed:", "connection to server failed:"):
        if text.lower().startswith(prefix):
            return text[len(prefix) :].strip()
    return text
