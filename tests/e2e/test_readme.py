"""The Python snippets of the README and docs/jobs.md run as pasted (issue 32),
against `make run`'s model names (fake servers here); the README's prints the
reply and the request id that `gpulane explain` takes."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.gateway import REPO, Gateway, fake_model

README = REPO / "README.md"
JOBS = REPO / "docs" / "jobs.md"
MAKE_RUN_MODELS = ("smollm2", "smollm2-long")


def snippets(path: Path) -> list[str]:
    return [str(c) for c in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)]


def run_snippet(
    gateway: Callable[[str], Gateway], tmp_path: Path, code: str
) -> tuple[Gateway, str]:
    """`code` run as pasted against a gateway serving make run's model names."""
    models = "".join(fake_model(m).replace("\n", "\n  ") for m in MAKE_RUN_MODELS)
    gw = gateway("models:" + models + "\n")
    assert '"http://127.0.0.1:8080/v1"' in code  # make run's address, replaced for the test
    script = tmp_path / "snippet.py"
    script.write_text(code.replace("http://127.0.0.1:8080", gw.url))
    ran = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    return gw, ran.stdout


@pytest.mark.parametrize("index", range(len(snippets(JOBS))))
def test_the_jobs_pages_python_snippets_run_as_pasted(
    gateway: Callable[[str], Gateway], tmp_path: Path, index: int
) -> None:
    run_snippet(gateway, tmp_path, snippets(JOBS)[index])


def test_the_readmes_python_snippet_prints_the_reply_and_the_request_id(
    gateway: Callable[[str], Gateway], tmp_path: Path
) -> None:
    (code,) = snippets(README)
    gw, out = run_snippet(gateway, tmp_path, code)
    reply, explain = out.splitlines()
    assert reply  # the fake server's answer
    assert explain.startswith("gpulane explain ")
    request_id = explain.split()[-1]
    gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'completed'", request_id)
    explained = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", request_id, "--db", str(gw.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert explained.returncode == 0, explained.stderr
    assert "smollm2-long" in explained.stdout and "batch" in explained.stdout
