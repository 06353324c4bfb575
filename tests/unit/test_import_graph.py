"""The house's imports run one way: ``cdc`` never imports ``sinks``, and no module circles back.

The graph is read from the source (the AST of every module of both packages),
every import counted: at the top, inside functions, under ``TYPE_CHECKING``.
``from package import name`` is an arrow to the module ``package.name`` when
that is a module, else to ``package``. The commands of ``sinks`` reach
``outbox-cdc`` through an entry point (no import, so no arrow).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cdc", "sinks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import in the module's source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                yield (target if target in known else base), node.lineno


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module of this house it imports: first line of that import}."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        arrows: dict[str, int] = {}
        for target, line in _imports(name, path, known):
            if target in known and target != name:
                arrows.setdefault(target, line)
        graph[name] = arrows
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as a path of modules (first == last), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                stack.pop()
                finished = path.pop()
                done.add(finished)
                on_path.discard(finished)
                continue
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                path.append(target)
                on_path.add(target)
                stack.append(iter(sorted(graph[target])))
    return None


def test_the_graph_reads_the_imports_it_claims_to() -> None:
    graph = _graph()
    # a top-level import, a lazy one inside a function, and one of a submodule by name
    assert "cdc.settings" in graph["cdc.cli.app"]
    assert "cdc.migrate" in graph["cdc.cli.relay"]
    assert "sinks.cli.render" in graph["sinks.cli.lag"]
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) is None


def test_no_module_of_cdc_imports_sinks() -> None:
    modules = _modules()
    known = set(modules)
    wrong = sorted(
        {
            f"{path.relative_to(ROOT)}:{line} imports {target}"
            for name, path in modules.items()
            if name.split(".")[0] == "cdc"
            for target, line in _imports(name, path, known)
            if target.split(".")[0] == "sinks"
        }
    )
    assert not wrong, "cdc is the kernel and the relay; it imports nothing of sinks:\n" + "\n".join(
        wrong
    )


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)
    )
