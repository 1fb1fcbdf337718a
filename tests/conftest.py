"""Session-wide checks for the whole suite.

The run must leave no process behind. Every process it starts, directly or
through a `gpulane serve` (which starts upstreams in sessions of their own, so
they are not always our descendants once a parent is gone), carries
`TEST_SESSION_VAR` in its environment. At the end of the session these fail the
run, each named with its command line: any live process carrying this run's
value, any live descendant of this pytest, and any upstream server
(`UPSTREAM_MARKS`) with no such variable at all that runs in this checkout and
was not there at the start (one a test started with an empty environment).
Other test runs on the same machine carry another value, so they are never
taken for ours, even in this checkout.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Set
from pathlib import Path

import psycopg
import pytest

from tests.postgres import SUPERUSER, Cluster
from tests.processes import cmdline, cwd, environ_value, kill_and_wait, parents

TEST_SESSION_VAR = "GPULANE_TEST_SESSION"
UPSTREAM_MARKS = ("tools.fake_upstream", "llama-server")
"""Command lines of the upstream servers tests start."""
REPO = Path(__file__).resolve().parents[1]
GRACE_S = 5.0
"""How long processes stopped by the last teardown get to finish exiting."""


def _upstream_here(pid: int) -> bool:
    """An upstream server whose working directory is this checkout."""
    if not any(mark in cmdline(pid) for mark in UPSTREAM_MARKS):
        return False
    where = cwd(pid)
    return where is not None and (where == REPO or REPO in where.parents)


def upstreams_here() -> set[int]:
    """The upstream servers running in this checkout now (another run's, say)."""
    return {pid for pid in parents() if _upstream_here(pid)}


def processes_left(session_id: str, before: Set[int] = frozenset()) -> dict[int, str]:
    """Live processes this test run started (see the module docstring), pid ->
    command line; `before` holds the upstreams here at the start."""
    me = os.getpid()
    tree = parents()

    def descends_from_me(pid: int) -> bool:
        seen = set()
        while pid in tree and pid not in seen:
            seen.add(pid)
            pid = tree[pid]
            if pid == me:
                return True
        return False

    def ours(pid: int) -> bool:
        value = environ_value(pid, TEST_SESSION_VAR)
        if value is not None:
            return value == session_id  # another run's otherwise, even in this checkout
        return pid not in before and _upstream_here(pid)

    return {
        pid: cmdline(pid)
        for pid in sorted(tree)
        if pid != me and (descends_from_me(pid) or ours(pid))
    }


def leftovers_after_grace(
    session_id: str, before: Set[int], grace: float = GRACE_S
) -> dict[int, str]:
    """`processes_left` once nothing is left or `grace` has passed; what is still
    there is then SIGKILLed, so a red run leaves nothing behind either."""
    deadline = time.monotonic() + grace
    while (left := processes_left(session_id, before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_and_wait(left)
    return left


def pytest_configure(config: pytest.Config) -> None:
    # Set before any test runs, so every process the run starts inherits it.
    os.environ[TEST_SESSION_VAR] = uuid.uuid4().hex


LLAMA_TIMEOUT_S = 1800
"""The per-test backstop (pyproject.toml's `timeout`) for a `llama` test: the
first one of a run may build llama-server and fetch its model (minutes)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("llama") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(LLAMA_TIMEOUT_S))


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fails the run (an error at the last teardown) naming each process it left
    running. Autouse and session-scoped in the root conftest: set up first, so
    torn down after every other fixture has stopped what it started."""
    before = upstreams_here()
    yield
    left = leftovers_after_grace(os.environ[TEST_SESSION_VAR], before)
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in left.items())
        pytest.fail(
            f"the test run left {len(left)} process(es) running (now killed):\n{lines}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """A throwaway PostgreSQL cluster for the run (tests/postgres.py), started on
    first use. Fails, never skips, when it cannot start: deselect its tests with
    `-m 'not postgres'` instead."""
    with Cluster.started() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: Cluster) -> Iterator[str]:
    """The SQLAlchemy URL of a new, empty PostgreSQL database, dropped afterwards."""
    url = postgres_cluster.new_database()
    yield url
    name = url.split("?")[0].rsplit("/", 1)[1]
    with psycopg.connect(
        host=str(postgres_cluster.data),
        port=postgres_cluster.port,
        user=SUPERUSER,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
