"""The sink process with a larger memory bound, for the benchmark of a large held set.

    python -m tests.bench.held_sink MAX_BUFFERED

Exactly ``outbox-cdc sink`` (settings from the environment, :func:`sinks.runtime.service.run_sink`)
but for the records one sink may hold (``sinks.runtime.sink.MAX_BUFFERED``): the bench holds
100,000 records, five times the default bound.
"""

from __future__ import annotations

import asyncio
import sys

from cdc.logs import setup_logging
from cdc.settings import Settings
from sinks.runtime import sink as consumer
from sinks.runtime.service import run_sink


def main(max_buffered: str) -> int:
    settings = Settings.from_env().require("pg_dsn", "kafka_bootstrap_servers")
    setup_logging(settings.log_level, settings.log_format)
    consumer.MAX_BUFFERED = int(max_buffered)
    return asyncio.run(run_sink(settings))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
