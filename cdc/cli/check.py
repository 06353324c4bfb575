"""``outbox-cdc check``: the preflight, item by item (:mod:`cdc.check`); exit 0 all ok, 1 else.

Runs the kernel's probes and every registered package's (``Plugin.checks``).
A bad setting is a finding here, not an exit 2: the answer lists everything at
once.
"""

from __future__ import annotations

import sys

import click

from cdc.cli.app import EXIT_FAILED, registered_checks
from cdc.cli.render import check_table, echo_json, out


@click.command()
@click.option("--json", "as_json", is_flag=True, help="the findings as JSON on stdout")
def check(as_json: bool) -> None:
    """Preflight: settings, PostgreSQL, Kafka, the engine; exit 1 when anything fails.

    Settings valid; PostgreSQL reachable with wal_level=logical; the role's
    REPLICATION; the outbox table, its publication and the slot (wal_status);
    Kafka reachable; the outbox topics' partitions against CDC_TOPIC_PARTITIONS;
    and what installed packages add (the sink: the engine reachable over TLS
    with the API key accepted, the parking lot). Changes nothing.
    """
    from cdc.check import KERNEL_PROBES, Status, fail, ok, run_probes
    from cdc.errors import ConfigError
    from cdc.settings import Settings

    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        findings = [fail("settings", str(exc))]
    else:
        findings = [
            ok("settings", "valid"),
            *run_probes(settings, (*KERNEL_PROBES, *registered_checks())),
        ]
    failing = [f for f in findings if f.status is Status.FAIL]
    if as_json:
        echo_json({"ok": not failing, "findings": [f.as_json() for f in findings]})
    else:
        out().print(check_table(findings))
    for finding in failing:
        click.echo(f"error: {finding.item}: {finding.detail}", err=True)
    if failing:
        sys.exit(EXIT_FAILED)
