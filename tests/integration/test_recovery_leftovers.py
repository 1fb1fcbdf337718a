"""Recovery stops what a crashed gpulane left, and nothing else: a process
running a model's exact cmd is stopped only when it carries this server's owner
marker (a placeholder cmd such as `sleep 300` may run outside gpulane too)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.config import parse_config
from app.runtime.log_buffer import LogBuffer
from app.runtime.recovery import recover
from app.runtime.scheduler import Scheduler
from app.store.engine import open_database
from app.store.event_store import SqliteEventStore

CMD = ["sleep", "307"]


def alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


@pytest.fixture
def leaders() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


async def test_only_a_leader_with_this_servers_marker_is_stopped(
    tmp_path: Path, leaders: list[subprocess.Popen[bytes]]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPULANE_UPSTREAM"}
    # Both lead their own group with the model's argv, as an upstream does.
    elsewhere = subprocess.Popen(CMD, env=env, start_new_session=True)
    left = subprocess.Popen(
        CMD, env={**env, "GPULANE_UPSTREAM": "own-1:m:0123"}, start_new_session=True
    )
    leaders += [elsewhere, left]
    deadline = time.monotonic() + 5
    while not all(
        Path(f"/proc/{p.pid}/cmdline").read_bytes() == b"sleep\x00307\x00" for p in leaders
    ):
        assert time.monotonic() < deadline, "the leaders did not exec"
        time.sleep(0.01)
    config = parse_config(
        f"models:\n  m:\n    cmd: {' '.join(CMD)}\n    proxy: http://127.0.0.1:9\n"
    )
    engine = open_database(str(tmp_path / "g.db"))
    store = SqliteEventStore(engine)
    store.start()
    try:
        scheduler = Scheduler(config, store, logs=LogBuffer(), owner="own-1")
        recovered = await recover(scheduler, engine, config.max_attempts)
    finally:
        await store.close()
        engine.dispose()
    assert left.wait(timeout=20) is not None
    assert alive(elsewhere)
    assert recovered.summary.processes_stopped >= 1
