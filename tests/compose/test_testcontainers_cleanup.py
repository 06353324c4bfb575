"""The testcontainers layer cleans up after itself without testcontainers' reaper.

The reaper (Ryuk) is an image of its own that no registry gives here: it is disabled
(tests/containers.py) and each session removes its containers by label - at its end,
and those of a session that died without its teardown when the next one starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.compose.conftest import docker
from tests.containers import LABEL, POSTGRES_IMAGE, remove_session_containers, session_label

pytestmark = pytest.mark.timeout(300)


def _labelled(value: str) -> list[str]:
    return docker("ps", "-a", "-q", "--filter", f"label={LABEL}={value}").split()


def test_containers_of_a_dead_session_are_removed_and_a_live_ones_kept(engine: None) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    dead_label = f"{session_label().rpartition(':')[0]}:{dead}"
    alive_label = session_label()
    for value in (dead_label, alive_label):
        docker("run", "-d", "--label", f"{LABEL}={value}", POSTGRES_IMAGE, "sleep", "300")
    try:
        removed = remove_session_containers()
        assert len(removed) == 1
        assert _labelled(dead_label) == []
        assert len(_labelled(alive_label)) == 1
        assert len(remove_session_containers(alive_label)) == 1
        assert _labelled(alive_label) == []
    finally:
        for value in (dead_label, alive_label):
            for container in _labelled(value):
                docker("rm", "-f", "-v", container)
