"""Every config llama-swap's own `internal/config` tests load, loaded here (issue 28).

The YAML is data: tests/fixtures/llama-swap/config-tests/ holds one file per
config, and `cases.json` says where each comes from and what llama-swap's test
expects of it (`llama_swap`: loads or fails). gpulane agrees, failing with an
error naming the key (`gpulane_error`), except for the cases marked `left`,
each with its reason: all of them are about keys gpulane ignores, or gpulane's
bound on matrix sets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.config import ConfigError, parse_config

CASES_DIR = (
    Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "llama-swap" / "config-tests"
)
MANIFEST = json.loads((CASES_DIR / "cases.json").read_text(encoding="utf-8"))
CASES: list[dict[str, Any]] = MANIFEST["cases"]
IGNORED_KEYS = ("selectors", "profiles", "capabilities", "performance", "store")


def outcome(case: dict[str, Any]) -> tuple[str, list[str]]:
    text = (CASES_DIR / case["file"]).read_text(encoding="utf-8")
    try:
        parse_config(text, source=case["file"], environ=case.get("env", {}))
    except ConfigError as exc:
        return "fails", exc.errors
    return "loads", []


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
