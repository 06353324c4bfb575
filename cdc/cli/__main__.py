"""``python -m cdc.cli``: the ``outbox-cdc`` command."""

from cdc.cli import run

run()
