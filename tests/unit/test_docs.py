"""The README and the documentation site hold to the code.

* Every ``outbox-cdc ...`` command in a code block of the docs parses against the
  real command line (subcommand, options and their values, as click parses them),
  and every ``outbox-cdc ...`` written inline (a synopsis such as ``outbox-cdc lag
  [--group G]``) names subcommands and options that exist.
* Every subcommand the docs show is run by some test under tests/: its words
  appear as a command line in a test (a list, tuple or call of string literals,
  at its start or right after ``cdc.cli`` / ``outbox-cdc``).
* Every ``make`` command shown names a target of the Makefile.
* The README stays a front door: at most 250 lines, and its relative links resolve.
* The configuration page's TOML example loads as a settings file.
* Every page is in the site's navigation, and ``mkdocs.yml`` makes an orphan page, a
  broken link or anchor a warning (so ``mkdocs build --strict`` fails on it), with no
  plugin that reaches the network.

The site's own links, anchors and navigation are checked by ``make docs``
(``mkdocs build --strict``); the configuration reference's generator is tested in
tests/unit/test_settings.py, the alerts, dashboard and metrics pages in
tests/unit/test_observability_files.py.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from cdc.cli import command_line
from cdc.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The README is what a newcomer reads in five minutes; the manual is the site.
README_MAX_LINES = 250
#: Fenced blocks whose every line is a shell command (others: only ``$ `` lines).
SHELL_LANGUAGES = {"sh", "bash", "shell"}
_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")
_INLINE = re.compile(r"`((?:\S*/)?outbox-cdc [^`]+)`")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_MAKE_TARGET = re.compile(r"^([A-Za-z][\w-]*)\s*:(?!=)", re.MULTILINE)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@dataclass(frozen=True)
class Shown:
    """A command as the docs show it: where, and its words."""

    where: str
    words: tuple[str, ...]
    #: True: from a code block (a full command line); False: inline (a synopsis).
    complete: bool


def _blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = _FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            body.append(lines[j])
            j += 1
        yield start.group(2).lower(), i + 1, body
        i = j + 1


def _command_lines(language: str, body: list[str]) -> Iterator[tuple[int, str]]:
    """The shell command lines of a block (continuations joined), with their offsets."""
    joined: list[tuple[int, str]] = []
    pending = ""
    for n, line in enumerate(body):
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        joined.append((n, text))
    for n, text in joined:
        if text.startswith("$ "):
            yield n, text[2:]
        elif language in SHELL_LANGUAGES:
            yield n, text


def _segments(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line: split at pipes, ``&&``, ``;`` and ``&``."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return
    current: list[str] = []
    for token in tokens:
        if token and set(token) <= set(";&|"):
            if current:
                yield current
            current = []
        else:
            current.append(token)
    if current:
        yield current


def _after_env(words: list[str]) -> list[str]:
    """``VAR=value ... cmd args`` -> ``cmd args``."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


def shown_commands(program: str) -> list[Shown]:
    """Every ``program ...`` command in the README and the docs (code blocks and inline)."""
    found: list[Shown] = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        name = str(page.relative_to(ROOT))
        in_block: set[int] = set()
        for language, first, body in _blocks(text):
            in_block.update(range(first, first + len(body) + 2))
            for n, line in _command_lines(language, body):
                for segment in _segments(line):
                    words = _after_env(segment)
                    if words and Path(words[0]).name == program:
                        found.append(Shown(f"{name}:{first + 1 + n}", tuple(words[1:]), True))
        if program != "outbox-cdc":
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if number in in_block:
                continue
            for span in _INLINE.findall(line):
                words = span.replace("\\|", "|").split()
                found.append(Shown(f"{name}:{number}", tuple(words[1:]), False))
    return found


# --- parsing against the real command line ---------------------------------------------------


def _remaining(ctx: click.Context) -> list[str]:
    """What a group's context left for its subcommand (click 8.1 and 8.2+ alike)."""
    protected = getattr(ctx, "_protected_args", None)
    if protected is None:
        protected = ctx.protected_args
    return [*protected, *ctx.args]


def parse(words: tuple[str, ...]) -> tuple[str, ...]:
    """Parse ``outbox-cdc <words>`` as click would, without running it: the command path.

    Raises click's error (an unknown command or option, a missing or bad value).
    """
    command: click.Command = command_line()
    path: list[str] = []
    ctx = command.make_context("outbox-cdc", list(words))
    while isinstance(command, click.Group):
        rest = _remaining(ctx)
        if not rest:
            break
        name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        path.append(name)
        command = sub
        ctx = command.make_context(name, args, parent=ctx)
    return tuple(path)


def synopsis_path(words: tuple[str, ...]) -> tuple[tuple[str, ...], click.Command]:
    """The subcommands a synopsis names (``slot recover [--execute]`` -> slot, recover)."""
    command: click.Command = command_line()
    path: list[str] = []
    for word in words:
        if not isinstance(command, click.Group) or word not in command.commands:
            break
        command = command.commands[word]
        path.append(word)
    return tuple(path), command


def option_names(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return names


SHOWN = shown_commands("outbox-cdc")


def test_the_docs_show_commands() -> None:
    complete = [s for s in SHOWN if s.complete]
    assert len(complete) > 40, "the extraction found too few commands: is it broken?"
    assert len(SHOWN) - len(complete) > 20


@pytest.mark.parametrize("shown", [s for s in SHOWN if s.complete], ids=lambda s: s.where)
def test_every_command_in_a_code_block_parses(shown: Shown) -> None:
    try:
        path = parse(shown.words)
    except click.exceptions.Exit:  # --help, --version: parsed, then asked to stop
        return
    except click.ClickException as exc:
        pytest.fail(f"{shown.where}: outbox-cdc {' '.join(shown.words)}: {exc.format_message()}")
    assert path, f"{shown.where}: outbox-cdc {' '.join(shown.words)} names no subcommand"


@pytest.mark.parametrize("shown", [s for s in SHOWN if not s.complete], ids=lambda s: s.where)
def test_every_inline_command_names_real_subcommands_and_options(shown: Shown) -> None:
    path, command = synopsis_path(shown.words)
    if not path and shown.words[0] not in {"--help", "--version"}:
        pytest.fail(f"{shown.where}: `outbox-cdc {' '.join(shown.words)}`: no such command")
    if isinstance(command, click.Group) and len(shown.words) > len(path):
        nxt = shown.words[len(path)]
        assert nxt.startswith(("-", "…", "(", "[")), f"{shown.where}: no command {nxt!r}"
    unknown = set(_OPTION.findall(" ".join(shown.words[len(path) :]))) - option_names(command)
    assert not unknown, f"{shown.where}: outbox-cdc {' '.join(path)} has no {sorted(unknown)}"


# --- every subcommand shown is run by a test -------------------------------------------------


def _string_runs(tree: ast.AST) -> Iterator[list[str]]:
    """The string literals of every list, tuple and call's arguments, in order."""
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            items = node.elts
        elif isinstance(node, ast.Call):
            items = node.args
        else:
            continue
        run = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        if run:
            yield run


def commands_the_tests_run() -> list[list[str]]:
    """The command lines the tests run: string runs from the start or after the program."""
    lines: list[list[str]] = []
    for path in (ROOT / "tests").rglob("*.py"):
        for run in _string_runs(ast.parse(path.read_text(encoding="utf-8"))):
            starts = [0] + [
                i + 1 for i, s in enumerate(run) if s == "cdc.cli" or s.endswith("outbox-cdc")
            ]
            lines += [run[i:] for i in starts]
    return lines


def shown_subcommands() -> dict[tuple[str, ...], str]:
    """Every command path the docs show -> one place it is shown."""
    paths: dict[tuple[str, ...], str] = {}
    for shown in SHOWN:
        path, _ = synopsis_path(shown.words)
        for depth in range(1, len(path) + 1):
            paths.setdefault(path[:depth], shown.where)
    return paths


def untested_subcommands() -> dict[tuple[str, ...], str]:
    lines = commands_the_tests_run()
    return {
        path: where
        for path, where in shown_subcommands().items()
        if not any(tuple(line[: len(path)]) == path for line in lines)
    }


def test_every_subcommand_the_docs_show_is_run_by_a_test() -> None:
    shown = shown_subcommands()
    assert ("slot", "accept-gap") in shown and ("relay",) in shown
    missing = untested_subcommands()
    assert not missing, "shown in the docs, run by no test: " + ", ".join(
        f"outbox-cdc {' '.join(p)} ({where})" for p, where in sorted(missing.items())
    )


def test_the_test_scan_finds_command_lines_of_every_shape() -> None:
    lines = commands_the_tests_run()
    for expected in (["relay"], ["slot", "accept-gap"], ["migrate", "--demo"], ["demo"]):
        assert any(line[: len(expected)] == expected for line in lines), expected


# --- make ------------------------------------------------------------------------------------


def test_every_make_command_shown_names_a_target() -> None:
    targets = set(_MAKE_TARGET.findall((ROOT / "Makefile").read_text(encoding="utf-8")))
    shown = shown_commands("make")
    assert any(s.words == ("demo",) for s in shown) and any(s.words == ("test",) for s in shown)
    for s in shown:
        goals = [w for w in s.words if not w.startswith("-") and "=" not in w]
        assert goals, f"{s.where}: make without a target"
        assert set(goals) <= targets, f"{s.where}: make {' '.join(s.words)}: no such target"


# --- the README ------------------------------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move some to docs/"
    text = "\n".join(lines)
    for must in ("make demo", "make test", "## The two commands", "docs/record-contract.md"):
        assert must in text, must


def test_the_readmes_relative_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


# --- the configuration page ------------------------------------------------------------------


def test_the_configuration_pages_toml_example_loads(tmp_path: Path) -> None:
    page = (DOCS / "configuration" / "index.md").read_text(encoding="utf-8")
    blocks = [body for language, _, body in _blocks(page) if language == "toml"]
    assert blocks
    for body in blocks:
        path = tmp_path / "outbox-cdc.toml"
        path.write_text("\n".join(body), encoding="utf-8")
        settings = Settings.from_env({}, config_file=str(path))
        assert settings.model_dump() != Settings().model_dump()


# --- the site's configuration ----------------------------------------------------------------


def _nav_pages(nav: object) -> Iterator[str]:
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from _nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from _nav_pages(value)


def test_every_page_is_in_the_nav_and_strict_mode_would_say_so() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    in_nav = list(_nav_pages(config["nav"]))
    on_disk = {
        str(p.relative_to(DOCS))
        for p in DOCS.rglob("*.md")
        if not p.is_relative_to(DOCS / "_hooks")
    }
    assert len(in_nav) == len(set(in_nav)), "a page is in the nav twice"
    assert set(in_nav) == on_disk
    # mkdocs build --strict fails on warnings: these make an orphan page, a broken link
    # or a missing anchor a warning (their defaults are "info" for some).
    assert config["validation"] == {
        "omitted_files": "warn",
        "not_found": "warn",
        "absolute_links": "warn",
        "unrecognized_links": "warn",
        "anchors": "warn",
    }
    assert set(config["plugins"]) <= {"search", "offline"}, "no plugin that reaches the network"


def _migration_versions() -> list[str]:
    files = [*(ROOT / "sql").glob("[0-9]*.sql"), *(ROOT / "sql" / "demo").glob("[0-9]*.sql")]
    return sorted(path.name.split("_", 1)[0] for path in files)


def test_the_sample_migration_lists_are_what_a_run_applies() -> None:
    """The demo's `schema: applied ...` line and `migrate --status`'s table list every
    migration of sql/ (and sql/demo/), as a run on a fresh database applies them."""
    versions = _migration_versions()
    demo = (DOCS / "getting-started" / "index.md").read_text(encoding="utf-8")
    [applied] = re.findall(r"^schema: applied (.+)$", demo, re.M)
    assert applied.split(", ") == versions
    status = (DOCS / "operations" / "commands.md").read_text(encoding="utf-8")
    block = status[status.index("$ outbox-cdc migrate --status\n") :]
    block = block[: block.index("```")]
    assert block.splitlines()[1] == f"{len(versions)} applied, 0 pending"
    assert re.findall(r"^│ (\d{3}) ", block, re.M) == versions
