"""The ``outbox-cdc`` command line: one command group, one module per command group.

What it is for: parse, build settings, call one library function, render the
answer. :mod:`cdc.cli.app` holds the group, settings loading and the one error
mapping (exit 0 done, 1 failed or refused, 2 usage or configuration);
:mod:`cdc.cli.render` the consoles, JSON and shared formats; :mod:`cdc.cli.relay`,
:mod:`cdc.cli.slot`, :mod:`cdc.cli.resync`, :mod:`cdc.cli.check` and :mod:`cdc.cli.audit`
the kernel's commands. What it may
import: the ``cdc`` kernel and the relay, never :mod:`sinks`: the sink's commands
arrive through the ``outbox_cdc.commands`` entry point (:func:`command_line`).
Invariant: whoever takes :data:`main` (the console script, ``python -m
cdc.cli``, a test) gets every installed command, each behind the error mapping;
the console script and ``python -m cdc.cli`` (:func:`run`) also end within a
bound on Ctrl-C (:mod:`cdc.cli.interrupt`).
"""

from __future__ import annotations

import functools

import click


@functools.cache
def command_line() -> click.Group:
    """The ``outbox-cdc`` group with the kernel's commands and every installed package's."""
    from cdc.cli import app, audit, check, relay, resync, slot

    kernel = (*relay.COMMANDS, slot.slot, resync.resync, check.check, audit.audit)
    app.register(app.Plugin(commands=kernel))
    app.register_installed()
    return app.main


def run() -> None:
    """The console script: Ctrl-C ends any command within a bound (:mod:`cdc.cli.interrupt`)."""
    from cdc.cli import interrupt

    interrupt.arm()
    command_line()()


def __getattr__(name: str) -> click.Group:
    # ``main`` is built on first use, not at import: a package that registers
    # commands imports cdc.cli.app, and so this package, while it is itself
    # being imported.
    if name == "main":
        return command_line()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
