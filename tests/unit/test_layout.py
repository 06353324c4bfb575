"""The house's layout: sinks/ is grouped by role, folders import downward, modules stay readable.

What it holds (read from the files, every import counted as
``test_import_graph.py`` counts them):

- ``sinks/`` holds folders only (besides ``__init__.py``): a newcomer finds the
  decision, the wire and Kafka from the folder names;
- every module of ``sinks/`` opens with a docstring (what it is for, what it
  guarantees);
- the folders of ``sinks/`` import each other in one direction only, the order
  of :data:`LAYERS` (bottom first): no arrow runs back up, so there is no circle
  between them either; ``sinks.core`` imports nothing of ``sinks`` outside it;
- no module of ``cdc`` or ``sinks`` passes :data:`MAX_LINES`, but the two named
  in :data:`EXCEPTED`.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

from tests.unit.test_import_graph import ROOT, _cycle, _modules
from tests.unit.test_import_graph import _graph as _read_graph

SINKS = ROOT / "sinks"

#: The folders of sinks/, from the bottom: each may import only the ones before it.
LAYERS = (
    "core",  # the decision: the state machine, offsets, retry policy, the error root
    "shared",  # what the roles above share: routes, tracing, bounded logs
    "engine",  # the wire: the engine client, one delivery, deadlines, http1
    "stub",  # a real engine stand-in (the route catalogue of shared)
    "idempotent",  # the toolkit for your own consumers (core's record reading)
    "parking",  # the parking lot (delivers through engine)
    "kafka",  # Kafka: the consumer's thread, offset expiry, the fetch watch
    "http",  # the process's endpoints: probes, metrics, the admin API and its guard
    "runtime",  # the process's shell: the loop around the core, parks, readiness, service
    "ops",  # group operations (the consumer's Kafka config, the parking lot)
    "trace",  # where is event X (ops' Kafka client)
    "console",  # the operator console: the pages of ops, trace, parking and the audit
    "cli",  # the commands, the preflight's items, the demo
)

#: A module a reader takes in at one sitting: about ten screens. Past it, a module
#: holds more than one role (the consumer shell did: its metrics, its Kafka
#: settings and its loop) and the parts want names of their own.
MAX_LINES = 600

#: Longer on purpose, each one thing that reads best whole.
EXCEPTED = {
    "sinks/core/machine.py": (
        "the core state machine: one class whose events and timer share every record's"
        " state (its endpoints' circuits and judgment, and the window, are modules of their own)"
    ),
    "cdc/wal/pgoutput.py": "the protocol codec: one decoder per pgoutput message",
}


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    """The house's import graph, read once for all the checks here."""
    return _read_graph()


def _sinks_modules() -> list[Path]:
    return sorted(SINKS.rglob("*.py"))


def _folder(module: str) -> str | None:
    """``sinks.engine.http1.pool`` -> ``engine``; ``sinks`` itself -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sinks" and len(parts) > 1 else None


def test_sinks_holds_folders_only_and_every_folder_has_its_place() -> None:
    loose = sorted(path.name for path in SINKS.glob("*.py") if path.name != "__init__.py")
    assert not loose, f"modules at the top of sinks/ (give each a folder by its role): {loose}"
    folders = sorted(path.name for path in SINKS.iterdir() if (path / "__init__.py").is_file())
    assert sorted(LAYERS) == folders, "LAYERS must name every folder of sinks/ once"


def test_every_module_of_sinks_lives_in_a_package_of_its_role() -> None:
    """No loose module anywhere under sinks/: each folder holding modules is a package
    (its ``__init__.py`` says what it is for), and sinks/ itself holds folders only."""
    loose = sorted(
        str(path.relative_to(ROOT))
        for path in _sinks_modules()
        if not (path.parent / "__init__.py").is_file()
    )
    assert not loose, f"modules in a folder that is not a package: {loose}"


def test_every_module_of_sinks_opens_with_a_docstring() -> None:
    missing = [
        str(path.relative_to(ROOT))
        for path in _sinks_modules()
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not missing, (
        f"modules without a docstring (what it is for, what it guarantees): {missing}"
    )


def test_the_folders_of_sinks_import_downward_only() -> None:
    graph = _graph()
    rank = {folder: index for index, folder in enumerate(LAYERS)}
    upward = sorted(
        f"{source} (line {line}) imports {target}: {_folder(target)} is above {_folder(source)}"
        for source, arrows in graph.items()
        for target, line in arrows.items()
        if (a := _folder(source)) is not None
        and (b := _folder(target)) is not None
        and a != b
        and rank[b] > rank[a]
    )
    assert not upward, "imports that run back up the layers of sinks/:\n" + "\n".join(upward)


def test_no_circle_between_the_folders_of_sinks() -> None:
    graph = _graph()
    folders: dict[str, dict[str, int]] = {folder: {} for folder in LAYERS}
    for source, arrows in graph.items():
        for target, line in arrows.items():
            a, b = _folder(source), _folder(target)
            if a is not None and b is not None and a != b:
                folders[a].setdefault(b, line)
    cycle = _cycle(folders)
    assert cycle is None, "folders of sinks/ in a circle: " + " -> ".join(
        f"{a} (line {folders[a][b]})" for a, b in itertools.pairwise(cycle)
    )


def test_the_core_imports_nothing_of_sinks_outside_it() -> None:
    graph = _graph()
    outside = sorted(
        f"{source} (line {line}) imports {target}"
        for source, arrows in graph.items()
        if _folder(source) == "core"
        for target, line in arrows.items()
        if target.split(".")[0] == "sinks" and _folder(target) != "core"
    )
    assert not outside, "sinks.core decides; it imports no shell:\n" + "\n".join(outside)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_passes_the_bound_but_the_named_ones() -> None:
    sizes = {str(path.relative_to(ROOT)): _lines(path) for path in _modules().values()}
    over = sorted(
        f"{name}: {lines} lines"
        for name, lines in sizes.items()
        if lines > MAX_LINES and name not in EXCEPTED
    )
    assert not over, f"modules over {MAX_LINES} lines (split by role):\n" + "\n".join(over)
    assert set(EXCEPTED) <= set(sizes), "a named module no longer exists"


def test_the_checks_see_what_they_claim_to() -> None:
    # the folder of a module, an upward arrow the rank would refuse, a line count
    assert _folder("sinks.engine.http1.pool") == "engine"
    assert _folder("sinks") is None
    graph = _graph()
    assert "sinks.core.errors" in graph["sinks.engine.client"]
    assert LAYERS.index("kafka") > LAYERS.index("engine")
    assert _lines(SINKS / "core" / "machine.py") > MAX_LINES
