"""The relay's house: folders by role, imports downward, the audit and the relay apart.

What it holds (read from the files, every import counted as
``test_import_graph.py`` counts them; that file already holds that ``cdc`` never
imports ``sinks``, and ``test_layout.py`` the line bound of every module):

- ``cdc/relay/`` holds folders only (besides ``__init__.py``): a newcomer finds
  where a rule of the relay lives from the folder names;
- every module of ``cdc/relay/`` opens with a docstring;
- the folders of ``cdc/relay/`` import each other in one direction only, the order
  of :data:`RELAY_LAYERS` (bottom first): no arrow runs back up;
- the audit imports nothing of the relay (the relay runs the audit and its
  start-up check; both repair through ``cdc.repair``, below them both), and
  ``cdc.repair``, ``cdc.kafka`` and ``cdc.settings`` import neither;
- the old top-level paths the sink still imports (:data:`OLD_PATHS`) only
  re-export, and nothing of ``cdc`` imports them;
- the loop hands over to its delivery mode at the points of
  :class:`cdc.relay.stream.mode.DeliveryMode` only: both tables of them (who calls
  each; which part of exactly-once implements it) name exactly those, both modes
  implement every one, and the exactly-once relay overrides nothing of the loop;
- no class of ``cdc/`` has more than :data:`MAX_BASES` base classes (composition,
  not mixins), and the exactly-once mode and its parts have none: it holds them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.unit.test_import_graph import ROOT
from tests.unit.test_import_graph import _graph as _read_graph

RELAY = ROOT / "cdc" / "relay"

#: The folders of cdc/relay/, from the bottom: each may import only the ones before it.
RELAY_LAYERS = (
    "health",  # state, metrics, the watches (silence, stall, Kafka readiness)
    "standby",  # the standby's wait, standby-safe mode
    "gaps",  # the gap decision, the guard, recovery, the confirm limit
    "stream",  # the loop and one record's path to Kafka
    "delivery",  # exactly-once on top of the stream
)

#: Packages of cdc below both the relay and the audit.
BELOW_BOTH = ("cdc.repair", "cdc.kafka", "cdc.settings")

#: Old top-level modules kept for the sink's imports: each re-exports its new home.
OLD_PATHS: dict[str, str] = {}


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    return _read_graph()


def _relay_folder(module: str) -> str | None:
    """``cdc.relay.gaps.guard`` -> ``gaps``; ``cdc.relay`` and other modules -> None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["cdc", "relay"] and len(parts) > 2 else None


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_relay_holds_folders_only_and_every_folder_has_its_place() -> None:
    loose = sorted(path.name for path in RELAY.glob("*.py") if path.name != "__init__.py")
    assert not loose, f"modules at the top of cdc/relay/ (give each a folder by its role): {loose}"
    folders = sorted(path.name for path in RELAY.iterdir() if (path / "__init__.py").is_file())
    assert sorted(RELAY_LAYERS) == folders, "RELAY_LAYERS must name every folder of cdc/relay/"


def test_every_module_of_the_relay_opens_with_a_docstring() -> None:
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted(RELAY.rglob("*.py"))
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not missing, f"modules without a docstring: {missing}"


def test_the_folders_of_the_relay_import_downward_only() -> None:
    rank = {folder: index for index, folder in enumerate(RELAY_LAYERS)}
    upward = sorted(
        f"{source} (line {line}) imports {target}: {b} is above {a}"
        for source, arrows in _graph().items()
        for target, line in arrows.items()
        if (a := _relay_folder(source)) is not None
        and (b := _relay_folder(target)) is not None
        and a != b
        and rank[b] > rank[a]
    )
    assert not upward, "imports that run back up the folders of cdc/relay/:\n" + "\n".join(upward)


def test_the_audit_imports_nothing_of_the_relay_and_repair_sits_below_both() -> None:
    graph = _graph()
    wrong = sorted(
        f"{source} (line {line}) imports {target}"
        for source, arrows in graph.items()
        for target, line in arrows.items()
        if (_under(source, "cdc.audit") and _under(target, "cdc.relay"))
        or (
            any(_under(source, low) for low in BELOW_BOTH)
            and (_under(target, "cdc.relay") or _under(target, "cdc.audit"))
        )
    )
    assert not wrong, "imports that run back up from the audit or repair:\n" + "\n".join(wrong)


def test_the_old_paths_only_re_export_and_cdc_does_not_use_them() -> None:
    graph = _graph()
    for old, new in OLD_PATHS.items():
        assert set(graph[old]) == {new}, f"{old} should import {new} only"
        tree = ast.parse((ROOT / Path(*old.split("."))).with_suffix(".py").read_text())
        kinds = {type(node).__name__ for node in tree.body}
        assert kinds <= {"Expr", "ImportFrom", "Assign"}, f"{old} defines something: {kinds}"
    users = sorted(
        f"{source} imports {target}"
        for source, arrows in graph.items()
        if source.startswith("cdc")
        for target in arrows
        if target in OLD_PATHS
    )
    assert not users, "cdc imports the new paths, not the sink's old ones:\n" + "\n".join(users)


def test_the_checks_see_what_they_claim_to() -> None:
    assert _relay_folder("cdc.relay.gaps.guard") == "gaps"
    assert _relay_folder("cdc.relay") is None
    assert _relay_folder("cdc.audit.run") is None
    graph = _graph()
    assert "cdc.relay.stream.loop" in graph["cdc.relay.delivery.exactly_once"]
    assert "cdc.audit.run" in graph["cdc.relay.gaps.start_check"]
    assert "cdc.repair.republish" in graph["cdc.audit.run"]


def _table_rows(doc: str | None) -> dict[str, str]:
    """{point: second column} of the table (between its second and third ``====`` rules)
    in a module docstring: the delivery mode's points (continuation lines skipped)."""
    lines = (doc or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    assert len(rules) >= 3, "no table in the docstring"
    rows = {}
    for line in lines[rules[1] + 1 : rules[2]]:
        if line and not line[0].isspace():
            parts = line.split()
            rows[parts[0]] = parts[1]
    return rows


def _protocol_points() -> set[str]:
    from cdc.relay.stream.mode import DeliveryMode

    return {name for name in vars(DeliveryMode) if not name.startswith("_")}


def test_every_point_of_the_delivery_mode_is_in_its_table_and_both_modes_implement_it() -> None:
    """The loop hands over to the delivery mode at the points of
    :class:`cdc.relay.stream.mode.DeliveryMode`: both tables (the points and who calls
    them; the exactly-once parts that implement them) name exactly those, and both modes
    implement every one."""
    from cdc.relay.delivery import exactly_once
    from cdc.relay.delivery.exactly_once import ExactlyOnceRelay
    from cdc.relay.stream import at_least_once, mode
    from cdc.relay.stream.loop import Relay
    from cdc.settings import Settings

    points = _protocol_points()
    assert {"wal_begins", "record", "wal_ends", "serve", "session_ends"} <= points
    assert set(_table_rows(mode.__doc__)) == points, "cdc/relay/stream/mode.py's table"
    assert set(_table_rows(exactly_once.__doc__)) == points, "exactly_once.py's table"
    settings = Settings(pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9")
    alo = Relay(settings, serve_http=False)
    eos = ExactlyOnceRelay(
        settings.model_copy(update={"delivery": "exactly-once"}), serve_http=False
    )
    for relay, kind in ((alo, at_least_once.AtLeastOnce), (eos, exactly_once.ExactlyOnce)):
        assert type(relay.mode) is kind
        missing = sorted(p for p in points if not callable(getattr(relay.mode, p, None)))
        assert not missing, f"{kind.__name__} does not implement {missing}"


def test_the_exactly_once_relay_overrides_nothing_of_the_loop() -> None:
    """Exactly-once is a delivery mode the loop calls, not a subclass that overrides
    the loop's hooks: ExactlyOnceRelay only picks its mode."""
    from cdc.relay.delivery.exactly_once import ExactlyOnceRelay
    from cdc.relay.stream.loop import Relay

    assert ExactlyOnceRelay.__bases__ == (Relay,)
    overridden = {name for name in vars(ExactlyOnceRelay) if not name.startswith("__")}
    assert not overridden, f"ExactlyOnceRelay overrides {sorted(overridden)}"


def test_the_exactly_once_mode_holds_its_parts_rather_than_inheriting_them() -> None:
    """Composition, not mixins (issue 51): the exactly-once mode has no base class; its
    parts are objects it holds, none sharing state with it through ``self``, and the
    points they implement are their own bound methods."""
    from cdc.relay.delivery.eos_steps import EosSteps
    from cdc.relay.delivery.epoch import EpochMoved
    from cdc.relay.delivery.exactly_once import ExactlyOnce, ExactlyOnceRelay
    from cdc.relay.delivery.overlap import CommitOverlap
    from cdc.settings import Settings

    assert ExactlyOnce.__bases__ == (object,)
    for part in (EosSteps, CommitOverlap, EpochMoved):
        assert part.__bases__ == (object,), part
    settings = Settings(
        pg_dsn="postgresql://x", kafka_bootstrap_servers="127.0.0.1:9", delivery="exactly-once"
    )
    eos = ExactlyOnceRelay(settings, serve_http=False).mode
    assert isinstance(eos, ExactlyOnce)
    steps, overlap = eos._steps, eos._overlap
    for point, owner in (
        ("wal_begins", steps),
        ("record", steps),
        ("wal_ends", steps),
        ("drain_dead_letters", overlap),
        ("read_wait_s", overlap),
    ):
        assert getattr(eos, point).__self__ is owner, point


#: The most base classes a class of cdc/ may have (composition, not mixins: cdc.relay.stream.mode).
MAX_BASES = 3


def test_no_class_of_cdc_has_more_than_three_base_classes() -> None:
    wide = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(node.bases)} bases)"
        for path in sorted((ROOT / "cdc").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and len(node.bases) > MAX_BASES
    )
    assert not wide, f"classes with more than {MAX_BASES} base classes:\n" + "\n".join(wide)


def test_the_base_class_check_sees_a_wide_class() -> None:
    tree = ast.parse("class A(B, C, D, E):\n    pass\n")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert len(node.bases) == 4 > MAX_BASES
