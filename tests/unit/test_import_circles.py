"""No import circles anywhere in app/ or tools/ (issue 33): every module
imports the others one way only, type-checking imports and imports inside
functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str, is_package: bool) -> set[str]:
    """The modules `path` imports, at any depth (TYPE_CHECKING too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module if is_package else module.rsplit(".", 1)[0]
                parent = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            # `from app.config import models` imports a module, not a name.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph(*folders: str) -> dict[str, set[str]]:
    paths = {module_name(p): p for folder in folders for p in (ROOT / folder).rglob("*.py")}
    return {
        name: imports_of(path, name, path.stem == "__init__") & paths.keys() - {name}
        for name, path in paths.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_walk_finds_a_circle_when_there_is_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_walk_sees_the_imports_that_make_circles() -> None:
    edges = graph("app", "tools")
    assert "app.config.resolved" in edges["app.config.resolution"]
    assert "app.core.state" in edges["app.core.policy"]
    assert "tools.replay.simulate" in edges["tools.replay.truth"]


def test_app_and_tools_have_no_import_circles() -> None:
    assert circles(graph("app", "tools")) == []
