"""A real half-open path for tests: every packet of one TCP connection dropped in the kernel.

``DroppedPath(client_port, server_port)`` adds an nftables table of its own
(``inet``, an ``output`` hook: loopback packets of both directions pass it)
that drops the packets of that one loopback 4-tuple, both ways, and deletes
the table on exit. Unlike a user-space proxy, no kernel ACKs anything sent on
that connection: unacknowledged data ends it by ``tcp_user_timeout``, the peer
hears nothing - a dead link, a NAT or firewall that forgot the mapping. Every
other connection, new ones between the same hosts included, passes.

It needs root (CAP_NET_ADMIN) and ``nft``: :func:`ensure_nft` installs Debian's
``nftables`` package with apt-get when it is missing and the process is root
(CI's fresh machine), and raises :class:`NetFaultUnavailableError` naming what is
missing otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from types import TracebackType

#: apt-get waits this long for another apt-get (the stack's own installs) to finish.
APT_LOCK_TIMEOUT_S = 300


class NetFaultUnavailableError(RuntimeError):
    """nftables cannot be used here; the message says why."""


def _run(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)


def ensure_nft() -> str:
    """The path of ``nft``, installed first when missing (root only)."""
    found = shutil.which("nft") or next(
        (p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None
    )
    if found is None:
        if os.geteuid() != 0:
            raise NetFaultUnavailableError(
                "nft is missing and this is not root: apt-get install nftables"
            )
        env_apt = ("env", "DEBIAN_FRONTEND=noninteractive", "apt-get")
        lock = f"-oDPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"
        install = (*env_apt, lock, "install", "-y", "-qq", "--no-install-recommends", "nftables")
        done = _run(*install)
        if done.returncode != 0:  # (a fresh machine: no package lists yet)
            _run(*env_apt, lock, "update", "-qq")
            done = _run(*install)
        if done.returncode != 0:
            why = done.stderr.strip()
            raise NetFaultUnavailableError(f"apt-get install nftables failed: {why}")
        found = shutil.which("nft") or "/usr/sbin/nft"
    probe = f"outbox_cdc_probe_{uuid.uuid4().hex[:8]}"
    made = _run(found, "add", "table", "inet", probe)
    if made.returncode != 0:
        raise NetFaultUnavailableError(f"nft cannot add a table here: {made.stderr.strip()}")
    _run(found, "delete", "table", "inet", probe)
    return found


class DroppedPath:
    """Drops every packet of the loopback connection ``client_port`` <-> ``server_port``."""

    def __init__(self, client_port: int, server_port: int, *, host: str = "127.0.0.1") -> None:
        self.nft = ensure_nft()
        self.table = f"outbox_cdc_drop_{uuid.uuid4().hex[:8]}"
        self.client_port, self.server_port, self.host = client_port, server_port, host

    def _nft(self, *args: str) -> None:
        done = _run(self.nft, *args, timeout_s=30)
        if done.returncode != 0:
            raise NetFaultUnavailableError(f"nft {' '.join(args)}: {done.stderr.strip()}")

    def __enter__(self) -> DroppedPath:
        self._nft("add", "table", "inet", self.table)
        self._nft(
            "add chain inet " + self.table + " out"
            " { type filter hook output priority 0 ; policy accept ; }"
        )
        try:
            for sport, dport in (
                (self.client_port, self.server_port),
                (self.server_port, self.client_port),
            ):
                self._nft(
                    "add", "rule", "inet", self.table, "out", "ip", "saddr", self.host,
                    "ip", "daddr", self.host, "tcp", "sport", str(sport),
                    "tcp", "dport", str(dport), "drop",
                )  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """The path passes again (the table is deleted)."""
        _run(self.nft, "delete", "table", "inet", self.table, timeout_s=30)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
