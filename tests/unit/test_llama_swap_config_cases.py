"""Every config llama-swap's own `internal/config` tests load, loaded here (issue 28).

The YAML is data: tests/fixtures/llama-swap/config-tests/ holds one file per
config, and `cases.json` says where each comes from and what llama-swap's test
expects of it (`llama_swap`: loads or fails). gpulane agrees, failing with an
error naming the key (`gpulane_error`), except for the cases marked `left`,
each with its reason: all of them are about keys gpulane ignores, or gpulane's
bound on matrix sets.

Loading is not enough: where llama-swap's test checks the values a config
resolves to (a model's `ttl` under `globalTTL`, its `unloadTimeout`, a `cmd`
with its macros and port), `values` holds them, by their path in the file's
own keys, and the config gpulane loads says the same (`check-config`'s file
form, app/config/file_form.py). `values_differ` holds where gpulane resolves a
value differently on purpose, both values and `values_differ_why`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from app.config import Config, ConfigError, parse_config
from app.config.file_form import file_form

CASES_DIR = (
    Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "llama-swap" / "config-tests"
)
MANIFEST = json.loads((CASES_DIR / "cases.json").read_text(encoding="utf-8"))
CASES: list[dict[str, Any]] = MANIFEST["cases"]
IGNORED_KEYS = ("selectors", "profiles", "capabilities", "performance", "store")


def load(case: dict[str, Any]) -> Config:
    text = (CASES_DIR / case["file"]).read_text(encoding="utf-8")
    return parse_config(text, source=case["file"], environ=case.get("env", {}))


def outcome(case: dict[str, Any]) -> tuple[str, list[str]]:
    try:
        load(case)
    except ConfigError as exc:
        return "fails", exc.errors
    return "loads", []


def resolved(form: dict[str, Any], path: str) -> Any:
    """The value at `path` (keys joined by dots) of a config's file form; a
    command as its argv, so quoting the form adds (`'${PID}'`) does not count."""
    node: Any = form
    for key in path.split("."):
        assert isinstance(node, dict) and key in node, f"{path}: no {key!r} in {node!r}"
        node = node[key]
    return shlex.split(node) if path.endswith((".cmd", ".cmdStop")) else node


def expected(path: str, value: Any) -> Any:
    return shlex.split(value) if path.endswith((".cmd", ".cmdStop")) else value


VALUED = [c for c in CASES if "values" in c or "values_differ" in c]


@pytest.mark.parametrize("case", CASES, ids=[c["file"].removesuffix(".yaml") for c in CASES])
def test_a_llama_swap_test_config_loads_here_as_it_loads_there(case: dict[str, Any]) -> None:
    expected = case.get("gpulane", case["llama_swap"])
    got, errors = outcome(case)
    assert got == expected, errors
    if got == "fails":
        key = case["gpulane_error"]
        assert any(
            e == key or e.startswith(f"{key}:") or e.startswith(f"{key}[") for e in errors
        ), errors


@pytest.mark.parametrize("case", VALUED, ids=[c["file"].removesuffix(".yaml") for c in VALUED])
def test_a_llama_swap_test_config_resolves_to_the_values_its_test_checks(
    case: dict[str, Any],
) -> None:
    form = file_form(load(case))
    for path, value in case.get("values", {}).items():
        got = resolved(form, path)
        assert got == expected(path, value), (path, got)
        assert (type(got) is bool) == (type(value) is bool), (path, got)
    for path, both in case.get("values_differ", {}).items():
        got = resolved(form, path)
        assert got == expected(path, both["gpulane"]), (path, got, case["values_differ_why"])
        assert got != expected(path, both["llama_swap"])


def test_the_values_compared_are_those_llama_swaps_tests_check() -> None:
    valued = [c for c in CASES if "values" in c]
    assert len(valued) >= 40 and all(c["llama_swap"] == "loads" for c in VALUED)
    for case in VALUED:
        assert "values_differ" not in case or case["values_differ_why"], case["file"]
    # The figures the README states.
    readme = (CASES_DIR / "README.md").read_text(encoding="utf-8")
    same = sum(len(c["values"]) for c in valued)
    differ = [c for c in VALUED if "values_differ" in c]
    assert f"{same} values in {len(valued)} configs resolve here" in readme
    differing = sum(len(c["values_differ"]) for c in differ)
    assert f"{differing} values in {len(differ)} configs differ" in readme
    # The overrides the issue names: a model's ttl and unloadTimeout over the global ones.
    files = {c["file"] for c in valued}
    assert "config-globalttl-model-explicit-ttl-overrides-globalttl.yaml" in files
    assert "config-unloadtimeout-model-unloadtimeout-overrides-global.yaml" in files


def test_every_vendored_config_is_a_case_and_every_case_a_file() -> None:
    files = {p.name for p in CASES_DIR.glob("*.yaml")}
    assert files == {c["file"] for c in CASES}
    readme = (CASES_DIR / "README.md").read_text(encoding="utf-8")
    for case in CASES:
        assert f"`{case['file']}`" in readme, case["file"]
        assert case["source"].startswith("internal/config/") and case["test"].startswith("Test")


def test_the_cases_left_are_few_and_each_says_why() -> None:
    left = [c for c in CASES if "left" in c]
    for case in left:
        assert case["gpulane"] != case["llama_swap"]
        assert case["left"].split(" ")[0] in (*IGNORED_KEYS, "gpulane"), case["left"]
    # The figure the README states: llama-swap and gpulane agree on the rest.
    readme = (CASES_DIR / "README.md").read_text(encoding="utf-8")
    assert f"{len(CASES) - len(left)} of {len(CASES)}" in readme
