"""The image's healthcheck: ``python -m cdc.healthcheck``, one command for every role.

The image (``compose/Dockerfile``) runs one process per container, ``outbox-cdc ROLE``
as PID 1; its ``HEALTHCHECK`` cannot know the role, so this module reads it from PID 1's
command line and asks the process what it answers:

* ``relay``       ``GET /readyz`` on ``CDC_RELAY_HTTP_PORT`` (streaming: 200);
* ``sink``        ``GET /readyz`` on ``SINK_HTTP_PORT`` (consuming: 200);
* ``engine-stub`` ``GET /_stub/stats`` on its ``--port`` or ``ENGINE_STUB_PORT``;
* anything else   (``migrate``, an ops command): healthy, there is nothing to ask.

Exit 0 healthy, 1 not (Docker's convention), with one line saying what answered.
It imports nothing but the standard library (it runs every few seconds) and reads the
ports the settings read, with the same defaults (checked by a unit test).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Bound of one probe. The container's healthcheck timeout (compose file, Dockerfile: 10 s)
#: is longer by the interpreter's start: a CI run on a busy host saw Docker end a probe
#: at its old 3 s bound (exit -1) while the relay answered.
PROBE_TIMEOUT_S = 5.0
#: Where the role is read: the command line of the container's main process.
MAIN_CMDLINE = Path("/proc/1/cmdline")
#: The address every role's HTTP listener answers on inside its container.
LOOPBACK = "127.0.0.1"
HEALTHY = 0
UNHEALTHY = 1


@dataclass(frozen=True)
class Probe:
    """What to ask a role: the port's setting (and its default) and the path."""

    port_env: str
    default_port: int
    path: str


#: role -> its probe (ports: the settings' variables and defaults, cdc.settings).
PROBES: dict[str, Probe] = {
    "relay": Probe("CDC_RELAY_HTTP_PORT", 9101, "/readyz"),
    "sink": Probe("SINK_HTTP_PORT", 9102, "/readyz"),
    "engine-stub": Probe("ENGINE_STUB_PORT", 8081, "/_stub/stats"),
}


def role_of(argv: Sequence[str]) -> str | None:
    """The first argument naming a probed role (``python outbox-cdc sink`` -> sink)."""
    return next((arg for arg in argv if arg in PROBES), None)


def port_of(role: str, argv: Sequence[str], env: Mapping[str, str]) -> int:
    """The role's port: a ``--port N`` / ``--port=N`` on its command line, else its setting."""
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    probe = PROBES[role]
    return int(env.get(probe.port_env, probe.default_port))


def url_for(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The URL that answers for the main process, or None when there is nothing to ask."""
    role = role_of(argv)
    if role is None:
        return None
    return f"http://{LOOPBACK}:{port_of(role, argv, env)}{PROBES[role].path}"


def check(url: str) -> tuple[int, str]:
    """(exit code, one line) of asking ``url``."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as answer:  # noqa: S310 - loopback http
            return HEALTHY, f"{url}: {answer.status}"
    except urllib.error.HTTPError as exc:
        first = exc.read(200).decode(errors="replace").partition("\n")[0]  # (the state)
        return UNHEALTHY, f"{url}: {exc.code} {first}"
    except (OSError, ValueError) as exc:
        return UNHEALTHY, f"{url}: {exc}"


def main() -> int:
    try:
        argv = MAIN_CMDLINE.read_bytes().decode(errors="replace").split("\0")
    except OSError as exc:
        print(f"cannot read {MAIN_CMDLINE}: {exc}")
        return UNHEALTHY
    try:
        url = url_for(argv, os.environ)
    except ValueError as exc:  # a port that is no number
        print(f"no port to ask: {exc}")
        return UNHEALTHY
    if url is None:
        print("no long-running role in the main process: nothing to ask")
        return HEALTHY
    code, line = check(url)
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
