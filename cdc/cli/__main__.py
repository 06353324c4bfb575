"""``python -m cdc.cli``: the ``outbox-cdc`` command."""

from cdc.cli import command_line

command_line()()
