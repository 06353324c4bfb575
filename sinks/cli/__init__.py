"""The sink side's commands of ``outbox-cdc``: one module per command group.

What it is for: ``sink``, ``engine-stub`` and ``demo`` (:mod:`sinks.cli.run`),
``lag``, ``replay``, ``redeliver``, ``failed`` and ``trace``, each parsing its
options, building settings and calling one library function; every view of
their answers is in :mod:`sinks.cli.render`. What it may import: ``cdc.cli``
(the group's helpers and shared formats), the ``cdc`` kernel and ``sinks``.
Invariant: the commands reach ``outbox-cdc`` only through :data:`PLUGIN`, the
``outbox_cdc.commands`` entry point of pyproject.toml, which also names how
this package's errors exit (an :class:`~sinks.ops.errors.OpsUsageError` is a usage
error, exit 2; any other :class:`~sinks.core.errors.SinksError` exit 1) and which items it
adds to ``outbox-cdc check`` (:mod:`sinks.cli.check`).
"""

from __future__ import annotations

from cdc.cli.app import Plugin
from sinks.cli import check, failed, lag, redeliver, replay, run, trace
from sinks.core.errors import SinksError
from sinks.ops.errors import OpsUsageError

PLUGIN = Plugin(
    commands=(
        run.sink,
        run.engine_stub,
        run.demo,
        lag.lag,
        replay.replay,
        redeliver.redeliver,
        failed.failed,
        trace.trace,
    ),
    usage_errors=(OpsUsageError,),
    failed_errors=(SinksError,),
    checks=check.PROBES,
)
