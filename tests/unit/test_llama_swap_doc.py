"""docs/llama-swap.md is kept true (issue 24, item 5): its tables of llama-swap's
config keys, flags and routes are read and checked against the code.

- Keys: the rows are exactly llama-swap's keys (its schema, vendored in
  tests/fixtures/llama-swap/, plus the few its Go structs take beyond it); a row
  marked works is a field of the raw config, one marked warns and ignores is in
  `IGNORED_KEYS` (or under one), and every `IGNORED_KEYS` entry has a row.
- Flags: the rows are exactly `LLAMA_SWAP_FLAGS`, each handled as its row says.
- Routes: a row marked served is in the app's route table, one marked not served
  or not yet is not, and every model-dispatched route of the app has a row.
"""

from __future__ import annotations

import asyncio
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import msgspec
import pytest
from litestar import Litestar
from litestar.exceptions import NotFoundException

from app.config import parse_config
from app.config.raw import IGNORED_KEYS, OPEN_STRUCTS, RawConfig
from app.llama_swap_cli import LLAMA_SWAP_FLAGS, FlagError, translate
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store.engine import open_database
from app.store.memory_store import InMemoryEventStore
from app.web.app import create_app
from app.web.comfyui_routes import comfyui_routes, open_renders
from app.web.forward import Forwarder
from app.web.jobs import JobRunner
from app.web.model_routes import FORM_ROUTES, GET_ROUTES, JSON_ROUTES
from app.web.proxy import Proxy
from app.web.serve import extra_routes
from app.web.videos_routes import open_videos, videos_routes

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "llama-swap.md"
SCHEMA = REPO / "tests" / "fixtures" / "llama-swap" / "config-schema.json"

SERVED = ("works", "works differently")
NOT_YET = re.compile(r"^not yet \(issue \d+\)$")
# Keys llama-swap's Go structs read that its schema leaves out.
BEYOND_SCHEMA = {
    "logRequests",
    "models.<id>.healthCheckTimeout",
    "models.<id>.filters.strip_params",  # the older spelling of stripParams
    "peers.<id>.timeouts.expectContinue",  # peers share the models' timeouts struct
}
ID = "<id>"


def table(heading: str) -> list[tuple[str, str]]:
    """(first cell without backticks, status) of each row of the table under `heading`."""
    text = DOC.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-"}:
            continue
        if cells[0] in ("key", "flag", "route"):
            continue
        rows.append((cells[0].strip("`"), cells[1]))
    assert rows, f"no table under ## {heading}"
    return rows


def test_statuses_are_the_documented_words() -> None:
    allowed = {
        "Config keys": (*SERVED, "warns and ignores"),
        "Command-line flags": (*SERVED, "warns and ignores", "refused"),
        "HTTP routes": (*SERVED, "not served"),
    }
    for heading, words in allowed.items():
        for first, status in table(heading):
            assert status in words or NOT_YET.match(status), f"{heading}: {first}: {status!r}"


# -- config keys ------------------------------------------------------------------


def _struct(typ: Any) -> Any:
    """The Struct (or dict type) a field's type holds: `RawMatrix | None` is RawMatrix."""
    if get_origin(typ) in (Union, types.UnionType):
        inner = [a for a in get_args(typ) if _is_struct(a) or get_origin(a) is dict]
        return inner[0] if inner else typ
    return typ


def _is_struct(typ: Any) -> bool:
    return isinstance(typ, type) and issubclass(typ, msgspec.Struct)


def accepts(path: str) -> str:
    """How the raw config takes a key path: "field", "ignored" (a warning, for it
    or a key above it) or "unknown" (an error)."""
    typ: Any = RawConfig
    for segment in path.split("."):
        typ = _struct(typ)
        if get_origin(typ) is dict:
            if segment != ID:
                return "unknown"
            typ = get_args(typ)[1]
        elif _is_struct(typ):
            fields = {f.encode_name: f.type for f in msgspec.structs.fields(typ)}
            if segment in fields:
                typ = fields[segment]
            elif segment in IGNORED_KEYS.get(typ, {}) or typ in OPEN_STRUCTS:
                return "ignored"
            else:
                return "unknown"
        else:
            return "unknown"
    return "field"


def struct_paths(typ: Any = RawConfig, path: str = "") -> Iterator[tuple[type, str]]:
    """Each raw Struct with the key path it is found at."""
    typ = _struct(typ)
    if get_origin(typ) is dict:
        yield from struct_paths(get_args(typ)[1], f"{path}.{ID}")
    elif _is_struct(typ):
        yield typ, path
        for f in msgspec.structs.fields(typ):
            yield from struct_paths(f.type, f"{path}.{f.encode_name}".lstrip("."))


def schema_paths() -> set[str]:
    schema = json.loads(SCHEMA.read_text())
    defs = schema.get("definitions") or schema.get("$defs") or {}
    out: set[str] = set()

    def walk(node: Any, path: str, seen: frozenset[str]) -> None:
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                walk(defs[name], path, seen | {name})
            return
        for key in ("oneOf", "anyOf", "allOf"):
            for sub in node.get(key, []):
                walk(sub, path, seen)
        for key, sub in node.get("properties", {}).items():
            out.add(f"{path}.{key}".lstrip("."))
            walk(sub, f"{path}.{key}".lstrip("."), seen)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.{ID}", seen)

    walk(schema, "", frozenset())
    return out


def test_every_key_row_loads_as_its_status_says() -> None:
    for key, status in table("Config keys"):
        how = accepts(key)
        if status in SERVED:
            assert how == "field", f"{key} is marked {status!r} but the config takes it as {how}"
        elif status == "warns and ignores":
            assert how == "ignored", f"{key} is marked {status!r} but the config takes it as {how}"
        else:  # not yet: it loads, used or not
            assert how != "unknown", f"{key} is marked {status!r} but is an unknown key"


def test_the_key_rows_are_exactly_llama_swaps_keys() -> None:
    rows = dict(table("Config keys"))
    schema = schema_paths()
    extra = set(rows) - schema - BEYOND_SCHEMA
    assert not extra, f"rows for keys llama-swap does not have: {sorted(extra)}"

    def covered(path: str) -> bool:
        parts = path.split(".")
        ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
        return path in rows or any(accepts(a) == "ignored" and a in rows for a in ancestors)

    keys = schema | BEYOND_SCHEMA
    # A section (`routing`, `models.<id>.filters`) needs no row of its own.
    leaves = {k for k in keys if not any(other.startswith(k + ".") for other in keys)}
    missing = sorted(p for p in leaves if not covered(p))
    assert not missing, f"llama-swap keys without a row in docs/llama-swap.md: {missing}"


def test_every_ignored_key_has_a_row() -> None:
    rows = dict(table("Config keys"))
    for cls, path in struct_paths():
        for key in IGNORED_KEYS.get(cls, {}):
            full = f"{path}.{key}".lstrip(".")
            assert full in rows, f"IGNORED_KEYS has {full} but docs/llama-swap.md has no row"


# -- flags ------------------------------------------------------------------------


def test_flag_rows_are_the_command_lines_flags() -> None:
    rows = {first.split()[0].lstrip("-"): status for first, status in table("Command-line flags")}
    assert set(rows) == set(LLAMA_SWAP_FLAGS)
    handling = {"maps": SERVED, "warns": ("warns and ignores",), "refuses": ("refused",)}
    for name, flag in LLAMA_SWAP_FLAGS.items():
        assert rows[name] in handling[flag.handling], (name, rows[name], flag.handling)


@pytest.mark.parametrize("name", sorted(LLAMA_SWAP_FLAGS))
def test_each_flag_is_handled_as_its_row_says(name: str) -> None:
    flag = LLAMA_SWAP_FLAGS[name]
    args = ["-config", "c.yaml"] if name not in ("config", "config-dir") else []
    args += [f"-{name}", "x.pem" if name.startswith("tls") else "v"] if flag.takes_value else []
    args += [f"-{name}"] if not flag.takes_value else []
    if name.startswith("tls"):
        args += ["-tls-cert-file", "c.pem", "-tls-key-file", "k.pem"]
    if flag.handling == "refuses":
        with pytest.raises(FlagError, match=f"-{name}"):
            translate(args)
        return
    translated = translate(args)
    if flag.handling == "warns":
        assert any(f"-{name}" in w for w in translated.warnings)
    else:
        assert translated.argv[:1] == ["serve"] or translated.print_and_exit is not None


# -- routes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Litestar]:
    tmp = tmp_path_factory.mktemp("routes")

    async def build() -> tuple[Litestar, Forwarder, Any]:
        config = parse_config("models:\n  m:\n    cmd: server --port ${PORT}\n")
        scheduler = Scheduler(config, InMemoryEventStore(), logs=LogBuffer())
        forwarder = Forwarder(config, scheduler)
        engine = open_database(str(tmp / "routes.db"))
        jobs = JobRunner(config, scheduler, forwarder, engine)
        built = create_app(
            config,
            scheduler,
            Proxy(config, scheduler, forwarder),
            LogBuffer(),
            engine=engine,
            extra_handlers=[
                *extra_routes(scheduler, jobs, engine),
                *comfyui_routes(open_renders(config, scheduler, jobs)),
                *videos_routes(open_videos(config, scheduler, jobs, str(tmp / "videos"))),
            ],
        )
        return built, forwarder, engine

    built, forwarder, engine = asyncio.run(build())
    yield built
    asyncio.run(forwarder.close())
    engine.dispose()


def routed(app: Litestar, route: str) -> bool:
    """Whether the app answers a llama-swap route (`GET /logs/stream/{id...}`)."""
    method, pattern = route.split(" ", 1)
    path = "/" if pattern == "/{$}" else re.sub(r"\{[^}]*\}", "m", pattern)
    path = path.rstrip("/") or "/"
    try:
        handler = app.asgi_router.handle_routing(path, "GET" if method == "ANY" else method)[1]
    except NotFoundException:
        return False
    methods = getattr(handler, "http_methods", None)  # None: raw ASGI, any method
    return method == "ANY" or methods is None or method in methods


def test_route_rows_match_the_route_table(app: Litestar) -> None:
    for route, status in table("HTTP routes"):
        if status in SERVED:
            assert routed(app, route), f"{route} is marked {status!r} but the app does not serve it"
        else:
            assert not routed(app, route), f"{route} is marked {status!r} but the app serves it"


def test_every_model_dispatched_route_has_a_row() -> None:
    rows = {route for route, _ in table("HTTP routes")}
    served = {f"POST {p}" for p in (*JSON_ROUTES, *FORM_ROUTES)} | {f"GET {p}" for p in GET_ROUTES}
    assert not served - rows, f"routes without a row: {sorted(served - rows)}"
