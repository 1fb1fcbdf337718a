"""Every example config in llama-swap's repository loads (issue 24, item 1), checked
with `gpulane check-config` as a user runs it: exit 0, warnings allowed.

The files are copies (tests/fixtures/llama-swap/README.md says from where, and
what was mended: only what llama-swap itself refuses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.gateway import REPO

FIXTURES = REPO / "tests" / "fixtures" / "llama-swap"
# The variables the examples read as ${env.NAME}; llama-swap needs them set too.
ENVIRONMENT = {"API_KEY_1": "sk-one", "API_KEY_2": "sk-two", "OPENROUTER_API_KEY": "sk-or"}


def gpulane() -> list[str]:
    script = Path(sys.executable).with_name("gpulane")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def test_every_example_is_vendored() -> None:
    readme = (FIXTURES / "README.md").read_text()
    for example in sorted(FIXTURES.glob("*.yaml")):
        assert f"`{example.name}`" in readme, f"{example.name} has no source in README.md"


@pytest.mark.parametrize("example", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_llama_swap_example_config_loads(example: str, tmp_path: Path) -> None:
    env = os.environ | ENVIRONMENT | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*gpulane(), "check-config", str(FIXTURES / example)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Whatever gpulane does not do is said, not silently dropped.
    for line in done.stderr.splitlines():
        assert line.startswith("warning: "), line
