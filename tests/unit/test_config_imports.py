"""app/config has no import circles (issue 33, item 4): its modules import one
another one way only, type-checking imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "app.config"


def imports_of(path: Path, module: str) -> set[str]:
    """The `app.config` modules `path` imports, at any depth (TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            # `from app.config import models` imports a module, not a name.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def config_graph() -> dict[str, set[str]]:
    folder = ROOT / "app" / "config"
    modules = {f"{PACKAGE}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {
        name: imports_of(path, name) & modules.keys() - {name} for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_walk_finds_a_circle_when_there_is_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_app_config_has_no_import_circles() -> None:
    graph = config_graph()
    assert "app.config.resolution" in graph and graph["app.config.resolution"]
    assert circles(graph) == []
