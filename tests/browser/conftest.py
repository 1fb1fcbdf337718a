"""Headless Chromium (Debian's `chromium`, installed by `make chromium`) driven by
Playwright for Python, against real `gpulane serve` processes (tests/e2e/gateway.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import gateway  # noqa: F401  (the same fixture as e2e)
from tests.e2e.gateway import REPO, free_port, poll

EXPECT_TIMEOUT_MS = 15_000
"""How long an expectation waits for its condition (a slow shared machine)."""


def chromium_path() -> str | None:
    return os.environ.get("GPULANE_CHROMIUM") or shutil.which("chromium")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module scope, not session: Playwright's sync API runs an event loop on this
    # thread while it is open, and pytest-asyncio cannot start one beside it, so it
    # must be closed before any later async test runs.
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: run `make chromium`")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium on PATH: run `make chromium` (Debian's chromium package)")
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as p:
        # Root (CI, containers) cannot use Chromium's user-namespace sandbox.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        launched = p.chromium.launch(executable_path=path, args=args, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert not errors, f"the page raised: {errors}"


class ReadOnlyConsole:
    """`gpulane ui --db FILE` as a user starts it, on a free port."""

    def __init__(self, db: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "ui", "--db", str(db), "--port", str(self.port)],
            cwd=REPO,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        poll(lambda: self._ready(log), f"gpulane ui to answer ({log})", timeout=30)

    def _ready(self, log: Path) -> bool:
        assert self.proc.poll() is None, log.read_text()
        try:
            return httpx.get(self.url + "/ui/api/info", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def readonly_console(tmp_path: Path) -> Iterator[Any]:
    started: list[ReadOnlyConsole] = []

    def start(db: Path) -> ReadOnlyConsole:
        console = ReadOnlyConsole(db, tmp_path / "ui.log")
        started.append(console)
        return console

    yield start
    for console in started:
        console.stop()
