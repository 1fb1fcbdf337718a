"""tools/replay imports without circles (issue 33: `cli.py` <-> `truth.py` was one).

Every import statement counts, at the top of a module, inside a function or under
`TYPE_CHECKING`: a circle hidden in a function is still two modules that cannot be
understood one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tools.replay"


def imports_of(package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports."""
    folder = ROOT.joinpath(*package.split("."))
    modules = {f"{package}.{f.stem}": f for f in folder.glob("*.py") if f.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if node.level == 0 else f"{package}.{node.module}"
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves again, one list per circle found (a path
    from a module back to it)."""
    found: list[list[str]] = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            here, path = stack.pop()
            for there in sorted(graph[here]):
                if there == start:
                    found.append(path)
                elif there not in seen:
                    seen.add(there)
                    stack.append((there, [*path, there]))
    return found


def test_tools_replay_has_no_import_circle() -> None:
    graph = imports_of(PACKAGE)
    assert f"{PACKAGE}.cli" in graph and f"{PACKAGE}.truth" in graph  # the walk found them
    assert f"{PACKAGE}.resources" in graph[f"{PACKAGE}.truth"]
    assert circles(graph) == []


def test_the_search_finds_a_circle_from_each_of_its_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
