"""Fixtures shared by the integration tests."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def free_tcp_port() -> Callable[[], int]:
    """Returns a function giving a port that was free a moment ago (bound to port 0)."""

    def pick() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    return pick


@pytest.fixture
def fake_upstream_argv() -> Callable[..., list[str]]:
    """argv for `python -m tools.fake_upstream --port PORT` plus any extra flags."""

    def argv(port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tools.fake_upstream", "--port", str(port), *extra]

    return argv


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""The databases every contract test runs on (as pyeventsourcing runs one recorder
suite per backend): SQLite always, PostgreSQL in a throwaway cluster."""


@pytest.fixture(params=BACKENDS)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty database as `--db` takes it: a file's path, or a PostgreSQL URL."""
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    return str(tmp_path / "gpulane.db")
