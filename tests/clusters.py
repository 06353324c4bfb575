"""A PostgreSQL primary and a streaming standby of the tests' own, for slot-loss tests.

Built once per test session (fixture ``cluster_pair`` in
``tests/integration/conftest.py``) with the server binaries ``compose/stack.sh``
runs (:func:`bindir`: ``OUTBOX_PG_BIN``, the stack's ``pg.current`` - ``make up PG=18``
- or the newest ``/usr/lib/postgresql/*/bin``), run as the ``postgres`` user
when the tests run as root (the server refuses root). Data lives under
``.dev/clusters/<session>`` (or a private directory in ``/tmp`` when ``postgres``
cannot reach the checkout) and is removed afterwards. Ports come from
:func:`tests.harness.free_port`; both nodes listen on 127.0.0.1 only and trust
local connections (throw-away clusters; the stack's server keeps its password).

What a test can do to them:

* the primary has ``wal_level=logical``, 1 MiB WAL segments and a small
  ``max_wal_size`` so WAL is recycled quickly; :meth:`PgNode.set_slot_keep`
  sets ``max_slot_wal_keep_size`` (ALTER SYSTEM + reload), :meth:`PgNode.push_wal_until_lost`
  writes and switches WAL and checkpoints until a slot's ``wal_status`` is ``lost``;
* the standby is a ``pg_basebackup -R`` copy streaming through a physical slot
  (:data:`STANDBY_SLOT`, also its ``application_name``) over a
  :class:`~tests.tcpfault.TcpFaultProxy`, so a test can hold back what it
  receives (``pair.wal_link.silence(new_connections=True)``);
* :meth:`ClusterPair.fail_over` stops the primary with ``-m immediate``, cuts the
  link (what the standby had not received is gone) and promotes the standby;
  :meth:`ClusterPair.heal` makes the pair whole again for the next test (the old
  primary's data is dropped and re-cloned as a standby of the new primary, on
  the same port, so DSNs stay valid);
* :meth:`ClusterPair.sync_slots` (PostgreSQL 17+) sets the pair up to carry failover
  slots to the standby; :meth:`ClusterPair.heal` resets it;
* :meth:`ClusterPair.dsn` is the multi-host DSN relays and writers use:
  ``host=127.0.0.1,127.0.0.1 port=<a>,<b> target_session_attrs=read-write``.

The same :class:`PgNode` serves the TLS tests alone (no standby): :meth:`PgNode.enable_tls`
turns ``ssl`` on with a server certificate of the tests' CA (:mod:`tests.pki`) and
replaces ``pg_hba.conf`` with the test's own lines; the test administers it through the
node's Unix socket (:meth:`PgNode.socket_dsn`), which TLS-only ``hostssl`` lines leave out.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from tests.harness import ROOT, free_port, wait_until
from tests.pki import Pki
from tests.tcpfault import TcpFaultProxy

#: The standby's physical slot on the primary, and its application_name.
STANDBY_SLOT = "outbox_standby"
SUPERUSER = "postgres"
START_TIMEOUT_S = 120
PRIMARY_CONF = """
listen_addresses = '127.0.0.1'
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
wal_keep_size = 0
max_slot_wal_keep_size = -1
max_wal_size = 4MB
min_wal_size = 2MB
checkpoint_timeout = 30min
wal_sender_timeout = 60s
wal_receiver_status_interval = 1s
hot_standby = on
shared_buffers = 32MB
max_connections = 60
# Throw-away test clusters: durability against OS crashes traded for speed
# (a crash of the server itself, pg_ctl stop -m immediate, loses nothing flushed).
fsync = off
full_page_writes = off
log_min_messages = warning
log_line_prefix = '%m [%p] %q%u@%d '
"""


def stack_bindir() -> Path | None:
    """The server binaries the stack runs (``pg.current`` of its ``.dev``, written by
    ``compose/stack.sh up``; ``OUTBOX_DEV_DIR`` names another stack's), or None."""
    dev = Path(os.environ.get("OUTBOX_DEV_DIR") or ROOT / ".dev")
    current = dev / "pg.current"
    if not current.exists():
        return None
    for line in current.read_text().splitlines():
        if line.startswith("bin="):
            return Path(line[len("bin=") :])
    return None


@functools.cache
def bindir() -> Path:
    """The server binaries of the tests' clusters: ``OUTBOX_PG_BIN``, else those the stack
    runs (``make up PG=18`` gives 18 to both), else the newest under /usr/lib/postgresql.
    They must carry pg_basebackup (zonky's 16/17 builds do not: their lane needs no pair)."""
    chosen = os.environ.get("OUTBOX_PG_BIN")
    found = Path(chosen) if chosen else stack_bindir()
    if found is None:
        system = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        if not system:
            raise RuntimeError("no PostgreSQL server under /usr/lib/postgresql/*/bin: run make up")
        found = Path(system[-1]).parent
    if not (found / "pg_basebackup").exists():
        raise RuntimeError(
            f"{found} has no pg_basebackup: the primary+standby clusters need a server build"
            " with it (the system's, or make up PG=18)"
        )
    return found


@functools.cache
def server_version_num() -> int:
    """``server_version_num`` of :func:`bindir`'s server (e.g. 180006)."""
    out = subprocess.run(
        [str(bindir() / "postgres"), "-V"], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"\(PostgreSQL\) (\d+)(?:\.(\d+))?", out)
    if found is None:
        raise RuntimeError(f"cannot read the server's version from {out!r}")
    return int(found[1]) * 10_000 + int(found[2] or 0)


def as_postgres(args: Sequence[str], *, timeout_s: float = START_TIMEOUT_S) -> str:
    """Run a server binary as the ``postgres`` user (as ourselves when not root)."""
    cmd = ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else list(args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")
        path.chmod(0o700)
    return path


def clusters_root() -> Path:
    """Where this session's clusters live: ``.dev/clusters/<id>``, else a dir in /tmp."""
    session = uuid.uuid4().hex[:8]
    base = ROOT / ".dev" / "clusters"
    try:
        root = _owned_dir(base / session)
        as_postgres(["test", "-w", str(root)])
        return root
    except (OSError, RuntimeError):
        return _owned_dir(Path("/tmp") / f"outbox-cdc-clusters-{session}")


@dataclass
class PgNode:
    """One PostgreSQL server of the pair (its role can change: a standby is promoted)."""

    name: str
    root: Path
    port: int = field(default_factory=free_port)

    @property
    def data(self) -> Path:
        return self.root / self.name / "data"

    @property
    def log(self) -> Path:
        return self.root / self.name / "postgresql.log"

    @property
    def run_dir(self) -> Path:
        return self.root / self.name / "run"

    def dsn(self, dbname: str = "postgres") -> str:
        return psycopg.conninfo.make_conninfo(
            host="127.0.0.1", port=self.port, user=SUPERUSER, dbname=dbname, connect_timeout=10
        )

    def socket_dsn(self, dbname: str = "postgres") -> str:
        """The superuser over the node's Unix socket (no TLS, no TCP ``pg_hba`` line)."""
        return psycopg.conninfo.make_conninfo(
            host=str(self.run_dir), port=self.port, user=SUPERUSER, dbname=dbname
        )

    def enable_tls(self, pki: Pki, hba: str) -> None:
        """``ssl = on`` with ``pki``'s server certificate and CA (client certificates are
        checked against it), and ``hba`` as the whole ``pg_hba.conf``; before :meth:`start`."""
        tls = _owned_dir(self.root / self.name / "tls")
        for source, name in (
            (pki.server_cert, "server.crt"),
            (pki.server_key, "server.key"),
            (pki.ca_cert, "ca.crt"),
        ):
            target = tls / name
            shutil.copyfile(source, target)
            target.chmod(0o600)  # the server refuses a key others may read
            if os.geteuid() == 0:
                shutil.chown(target, "postgres", "postgres")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"ssl = on\nssl_cert_file = '{tls / 'server.crt'}'\n"
                f"ssl_key_file = '{tls / 'server.key'}'\nssl_ca_file = '{tls / 'ca.crt'}'\n"
            )
        (self.data / "pg_hba.conf").write_text(hba)

    def _dirs(self) -> None:
        _owned_dir(self.root / self.name)
        _owned_dir(self.run_dir)

    def initdb(self) -> None:
        self._dirs()
        as_postgres(
            [
                str(bindir() / "initdb"),
                "-D",
                str(self.data),
                "-U",
                SUPERUSER,
                "-E",
                "UTF8",
                "--locale=C",
                "--auth=trust",
                "--wal-segsize=1",
            ]
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(PRIMARY_CONF)
            conf.write(f"unix_socket_directories = '{self.run_dir}'\n")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")

    def clone_from(self, primary: PgNode, link_port: int) -> None:
        """Become a streaming standby of ``primary`` through the proxy at ``link_port``."""
        shutil.rmtree(self.root / self.name, ignore_errors=True)
        self._dirs()
        with psycopg.connect(primary.dsn(), autocommit=True) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                " WHERE slot_name = %s",
                (STANDBY_SLOT,),
            )
        as_postgres(
            [
                str(bindir() / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                SUPERUSER,
                "-D",
                str(self.data),
                "-X",
                "stream",
                "-c",
                "fast",
                "-C",
                "-S",
                STANDBY_SLOT,
                "-R",
            ]
        )
        # dbname: what a standby's slot synchronization (PostgreSQL 17+) connects to
        conninfo = (
            f"host=127.0.0.1 port={link_port} user={SUPERUSER}"
            f" application_name={STANDBY_SLOT} dbname=postgres"
        )
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"primary_conninfo = '{conninfo}'\nprimary_slot_name = '{STANDBY_SLOT}'\n")
            conf.write(f"unix_socket_directories = '{self.run_dir}'\n")

    def start(self) -> None:
        as_postgres(
            [
                str(bindir() / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "-o",
                f"-p {self.port}",
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        if self.running():
            as_postgres([str(bindir() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        cmd = [str(bindir() / "pg_ctl"), "-D", str(self.data), "status"]
        try:
            as_postgres(cmd, timeout_s=30)
        except RuntimeError:
            return False
        return True

    def promote(self) -> None:
        as_postgres([str(bindir() / "pg_ctl"), "-D", str(self.data), "-w", "promote"])

    def in_recovery(self) -> bool:
        with psycopg.connect(self.dsn()) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def scalar(self, query: str, params: Sequence[object] = (), dbname: str = "postgres") -> object:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
        return None if row is None else row[0]

    def alter_system(self, **settings: str | None) -> None:
        """ALTER SYSTEM SET (a value) or RESET (None) each setting, then reload."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            for name, value in settings.items():
                if value is None:
                    conn.execute(sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier(name)))
                else:
                    conn.execute(
                        sql.SQL("ALTER SYSTEM SET {} = {}").format(
                            sql.Identifier(name), sql.Literal(value)
                        )
                    )
            conn.execute("SELECT pg_reload_conf()")

    # -- WAL retention ---------------------------------------------------------

    def set_slot_keep(self, size: str) -> None:
        """``max_slot_wal_keep_size`` (e.g. ``'2MB'``, ``'-1'``), applied by a reload."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER SYSTEM SET max_slot_wal_keep_size = {}").format(sql.Literal(size))
            )
            conn.execute("SELECT pg_reload_conf()")

    def wal_status(self, slot: str) -> str | None:
        value = self.scalar(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", [slot]
        )
        return None if value is None else str(value)

    def push_wal_until_lost(self, slot: str, *, timeout_s: float = 120.0) -> int:
        """Write WAL (large non-transactional messages), switch and checkpoint until the
        slot's ``wal_status`` is ``lost``; returns how many rounds it took."""
        rounds = 0
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                rounds += 1
                conn.execute(
                    "SELECT pg_logical_emit_message(false, 'test-push', repeat('x', 262144))"
                    " FROM generate_series(1, 4)"
                )
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
                row = conn.execute(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                ).fetchone()
                if row is not None and row[0] == "lost":
                    return rounds
        raise AssertionError(f"slot {slot} not lost after {rounds} rounds of WAL")


@dataclass
class ClusterPair:
    """A primary and a streaming standby (see the module docstring)."""

    root: Path
    nodes: list[PgNode]
    wal_link: TcpFaultProxy
    primary: PgNode
    standby: PgNode

    #: False: the standby streams straight from the primary (no pausable link; benchmarks)
    proxied_link: bool = True
    #: the standby carries failover slots (:meth:`sync_slots`); reset by :meth:`heal`
    slots_synced: bool = False

    @classmethod
    def create(cls, root: Path, *, proxied_link: bool = True) -> ClusterPair:
        a, b = PgNode("a", root), PgNode("b", root)
        a.initdb()
        a.start()
        link = TcpFaultProxy("127.0.0.1", a.port).start()
        pair = cls(root, [a, b], link, a, b, proxied_link)
        pair._attach_standby()
        return pair

    def dsn(self, dbname: str = "postgres") -> str:
        """Both nodes; libpq connects to whichever is the read-write primary."""
        return psycopg.conninfo.make_conninfo(
            host="127.0.0.1,127.0.0.1",
            port=f"{self.nodes[0].port},{self.nodes[1].port}",
            user=SUPERUSER,
            dbname=dbname,
            target_session_attrs="read-write",
            connect_timeout=5,
        )

    def _attach_standby(self) -> None:
        self.wal_link.reset()
        self.wal_link.resume()
        self.wal_link.retarget(self.primary.port)
        link = self.wal_link.port if self.proxied_link else self.primary.port
        self.standby.clone_from(self.primary, link)
        self.standby.start()
        wait_until(self.standby_streaming, 60, "standby streaming", interval_s=0.2)

    def standby_streaming(self) -> bool:
        value = self.primary.scalar(
            "SELECT count(*) FROM pg_stat_replication"
            " WHERE application_name = %s AND state = 'streaming'",
            [STANDBY_SLOT],
        )
        return value == 1

    def standby_caught_up(self) -> bool:
        """The standby replayed everything the primary has written so far."""
        target = self.primary.scalar("SELECT pg_current_wal_lsn()::text")
        replayed = self.standby.scalar(
            "SELECT pg_wal_lsn_diff(pg_last_wal_replay_lsn(), %s::text::pg_lsn) >= 0", [target]
        )
        return bool(replayed)

    def fail_over(self) -> None:
        """The primary crashes (``stop -m immediate``), the link drops what it held, the
        standby is promoted; afterwards ``primary`` is the promoted node, ``standby`` None-like
        (stopped) until :meth:`heal`."""
        old = self.primary
        old.stop("immediate")
        self.wal_link.reset()
        self.standby.promote()
        wait_until(lambda: not self.standby.in_recovery(), 60, "promotion", interval_s=0.2)
        self.primary, self.standby = self.standby, old

    def sync_slots(self, on: bool = True) -> None:
        """PostgreSQL 17+: the standby carries failover slots - ``sync_replication_slots``
        and ``hot_standby_feedback`` on it (its ``primary_conninfo`` names a database), the
        primary's ``synchronized_standby_slots`` naming its physical slot - or, ``on``
        False, none of it (every setting reset on the nodes that run)."""
        if on:
            self.standby.alter_system(sync_replication_slots="on", hot_standby_feedback="on")
            self.primary.alter_system(synchronized_standby_slots=STANDBY_SLOT)
            self.slots_synced = True
            return
        for node in self.nodes:
            if node.running():
                names = ["sync_replication_slots", "hot_standby_feedback"]
                if not node.in_recovery():
                    names.append("synchronized_standby_slots")
                node.alter_system(**dict.fromkeys(names))
        self.slots_synced = False

    def synced_slot(self, slot: str) -> tuple[str, bool] | None:
        """The standby's copy of ``slot``: (confirmed_flush_lsn, persistent), or None."""
        with psycopg.connect(self.standby.dsn(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT confirmed_flush_lsn::text, NOT temporary FROM pg_replication_slots"
                " WHERE slot_name = %s AND synced",
                (slot,),
            ).fetchone()
        return None if row is None else (str(row[0]), bool(row[1]))

    def healthy(self) -> bool:
        return (
            self.primary.running()
            and self.standby.running()
            and not self.primary.in_recovery()
            and self.standby.in_recovery()
            and self.standby_streaming()
        )

    def heal(self) -> None:
        """A running primary with a streaming standby again (after a failover or a pause)."""
        self.wal_link.resume()
        if self.slots_synced:  # a clone would copy the settings: the next test starts plain
            self.sync_slots(on=False)
        if self.healthy():
            return
        if not self.primary.running():
            self.primary.start()
        self.standby.stop("immediate")
        self._attach_standby()

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(RuntimeError):
                node.stop("immediate")
        self.wal_link.close()
        shutil.rmtree(self.root, ignore_errors=True)
