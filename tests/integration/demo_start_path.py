"""The demo's start path, run as a process by the tests, N times on one broker.

    python -m tests.integration.demo_start_path N LOG_DIR

Each round starts the engine stub, the relay and the sink as ``make demo`` does,
asks a new backlog guard its first check (the call that crashed librdkafka on a
broker that had just started), then a burst of first checks by fresh guards, and
stops the children. One line per round on stdout: ``round <i> <state> <child pids>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cdc.backlog import BacklogGuard
from cdc.settings import Settings
from sinks.cli.demo import demo_env, ensure_demo_topics, running_children

#: Fresh guards asked for their first check per round (each one a new set of clients).
FIRST_CHECKS_PER_ROUND = 5


def first_check(settings: Settings) -> str:
    guard = BacklogGuard(settings)
    try:
        return guard.check(group=settings.sink_group_id).state.value
    finally:
        guard.close()


def main(rounds: int, log_dir: Path) -> None:
    settings = Settings.from_env().require("pg_dsn", "kafka_bootstrap_servers")
    env = demo_env(settings)
    ensure_demo_topics(settings)  # as the demo does: the guard then has partitions to measure
    for i in range(rounds):
        with running_children(settings, log_dir, env) as children:
            states = [first_check(settings) for _ in range(FIRST_CHECKS_PER_ROUND)]
            pids = " ".join(str(c.proc.pid) for c in children)
            print(f"round {i} {states[0]} {pids}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
