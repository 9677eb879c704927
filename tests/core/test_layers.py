"""The floor plan (docs/architecture.md, whose layer table tests/core/test_docs.py holds to this
one): which part of tether may import which. Every import counts, function-local and
``TYPE_CHECKING`` ones included: a circle hidden at import time is still a circle for whoever
reads the code."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tether"

FOUNDATION = {"_exceptions", "_log", "_lazy"}
"""Any part may use these (they import nothing of tether), except where a row says otherwise."""

ALLOWED: dict[str, set[str]] = {
    "_exceptions": set(),
    "_log": set(),
    "_lazy": set(),
    "_versions": set(),  # setup.py loads it by path: it imports nothing of tether
    "config": {"_exceptions"},
    "events": {"_exceptions"},
    "job": {"events", "_exceptions", "_log"},
    "recorder": {"events", "config", "_versions"} | FOUNDATION,
    "watchdog": {"recorder", "job", "events", "config", "_versions"} | FOUNDATION,
    "server": {"job", "events", "config"} | FOUNDATION,
    "elastic": {"recorder", "job", "transport", "_versions"} | FOUNDATION,
    "runtime": {"recorder", "watchdog", "server", "job", "events", "config", "elastic"}
    | FOUNDATION,
    "api": {"runtime", "config", "events"} | FOUNDATION,
    "__init__": {"runtime", "config", "events", "api"} | FOUNDATION,
    "launcher": {"job", "events", "config"} | FOUNDATION,
    "analyze": {"events", "_exceptions"},
    # The version string comes from the package, which imports nothing heavy (PEP 562).
    "cli": {"analyze", "launcher", "job", "events", "config", "demo", "testing", "__init__"}
    | FOUNDATION,
    # the elastic demo's job uses the training-loop API, and FSDP2 for its HSDP layout
    "demo": {"elastic", "fsdp"} | FOUNDATION,
    "transport": {"_exceptions", "_log", "_versions"},
    "fsdp": {"_exceptions", "_versions"},  # torch's FSDP2, extended; apart from everything else
    # torch's pipelining, extended; likewise, but for torch's own variable (per-edge P2P)
    "pipelining": {"_versions", "config"} | FOUNDATION,
    "testing": {"_exceptions"},  # simulated nodes: the standard library and `ip`, nothing else
}
"""Part -> the parts it may import (its own modules always)."""

EXCEPTIONS = {"tether.launcher.bootstrap": {"runtime"}}
"""Modules allowed more than their part: the workers' entry point turns recording on."""

TORCH_FREE = ["tether.events", "tether.analyze", "tether.cli.show", "tether.job"]


def part_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Every tether module ``source`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tether")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tether":
                continue
            for alias in node.names:  # `from tether import _log` imports the module _log
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(module: str, imported: set[str]) -> list[str]:
    me = part_of(module)
    allowed = ALLOWED[me] | EXCEPTIONS.get(module, set()) | {me}
    return sorted(f"{module} imports {t}" for t in imported if part_of(t) not in allowed)


def modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_every_part_has_a_row() -> None:
    parts = {part_of(module_name(p)) for p in modules()}
    assert parts <= set(ALLOWED), f"parts without a row in the table: {parts - set(ALLOWED)}"


def test_every_import_follows_the_table() -> None:
    bad = []
    for path in modules():
        name = module_name(path)
        bad += violations(name, imports_of(path.read_text(), name, path.name == "__init__.py"))
    assert not bad, "\n".join(bad)


def import_graph() -> dict[str, set[str]]:
    """Every tether module -> the tether modules it imports (wherever the import statement is)."""
    graph = {}
    for path in modules():
        name = module_name(path)
        graph[name] = imports_of(path.read_text(), name, path.name == "__init__.py") - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, as the modules along it with the first repeated at the end; None
    if there is none. Depth first and iterative; a module is unseen, on the path, or done."""
    state: dict[str, str] = {}
    for root in sorted(graph):
        if root in state:
            continue
        path, todo = [root], [iter(sorted(graph[root]))]
        state[root] = "path"
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = "done"
                todo.pop()
            elif state.get(nxt) == "path":
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state and nxt in graph:
                state[nxt] = "path"
                path.append(nxt)
                todo.append(iter(sorted(graph[nxt])))
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    """No import cycle, within a folder or across folders: inside a part, modules form layers
    too. Every import counts, as above."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, ["b", "c", "d", "b"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"a": {"x"}}, None),  # outside the graph (not a tether module): no edge
    ],
)
def test_the_cycle_finder(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


@pytest.mark.parametrize(
    ("where", "source", "caught"),
    [
        ("tether.analyze.engine", "def f():\n    from tether.recorder import writer\n", True),
        (
            "tether.server.server",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from tether.watchdog.monitor import Monitor\n",
            True,
        ),
        ("tether.recorder.group", "from ..watchdog import monitor\n", True),
        ("tether.transport.tcp", "from tether import _log\n", False),
        ("tether.launcher.bootstrap", "from tether.runtime import install\n", False),
        ("tether.launcher.run", "from tether.runtime import install\n", True),
    ],
)
def test_the_checker_catches_hidden_imports(where: str, source: str, caught: bool) -> None:
    assert bool(violations(where, imports_of(source, where, False))) is caught


def test_readers_and_the_job_protocol_import_without_torch() -> None:
    packages = [p for p in modules() if module_name(p).startswith(("tether.events", "tether.job"))]
    names = sorted({*TORCH_FREE, *(module_name(p) for p in packages)})
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {names!r}:
            importlib.import_module(name)
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(",".join(heavy))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"torch was imported: {out.stdout.strip()[:300]}"
