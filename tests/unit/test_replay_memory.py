"""`replay --memory-budget`: the what-if memory router over the footprints a log
recorded, reporting the swaps it avoids and the lane's busy share; `--verify`
on a log with footprints."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core import events as ev
from app.runtime.gpu import FakeGpu, GpuMemory
from app.runtime.parameters import server_started
from tests.unit.run_loop_fakes import Lane, config_text, settle
from tools.replay.cli import replay_command
from tools.replay.generate import write_log
from tools.replay.resources import ResourcesError, memory_resources

GIB = 1024


async def alternating_log(tmp_path: Path) -> Path:
    """A B A B A B on one model at a time, each model measured at 30 GiB."""
    lane = Lane(config_text({"A": {}, "B": {}}, swapAffinityBonus=0), auto_load=False)
    gpu = FakeGpu(81_920, clock=lambda: lane.clock.now_ns / 1e9)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    for model in "ABABAB":
        ticket = lane.admit(model)
        await settle()
        upstream = lane.upstreams.last(model)
        if upstream.loading:
            assert upstream.pid is not None
            gpu.take(upstream.pid, 30 * GIB)
            await lane.clock.advance(2)
            upstream.load()
        await settle()
        await lane.clock.advance(1)
        await lane.finish(ticket)
        gpu.give_back(upstream.pid or 0)
    assert [e.gpu_memory_mib for e in lane.events(ev.SwapFinished)] == [30 * GIB] * 6
    db = tmp_path / "log.db"
    write_log(db, [server_started(lane.config, 0, 0), *lane.events()])
    return db


async def test_the_memory_budget_what_if_reports_the_swaps_it_avoids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = await alternating_log(tmp_path)
    assert replay_command([str(db), "--verify"]) == 0
    code = replay_command(
        [str(db), "--memory-budget", "80GiB", "--no-reference", "--jobs", "1", "--patience", "none"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(
        x for x in out.splitlines() if x.endswith(")") is False and " on memory 80GiB:" in x
    )
    assert " on memory 80GiB: 2 swaps, 4 avoided beside " in line
    assert "lane busy" in line


def test_a_budget_without_a_unit_is_refused() -> None:
    with pytest.raises(ResourcesError, match="--memory-budget"):
        memory_resources("80", {}, None, ["A"])


def test_models_of_unknown_size_are_named_in_the_label() -> None:
    what = memory_resources("80GiB", {"A": 100}, None, ["A", "B"])
    assert what.label == "memory 80GiB (1 of unknown size)"


async def test_explain_shows_the_footprint_the_evictions_and_the_memory_wait(
    tmp_path: Path,
) -> None:
    from app.report.explain import explain
    from app.report.render import explanation_text
    from app.store.engine import open_database

    lane = Lane(
        config_text({"A": {}, "B": {}}).replace('"models"', '"memoryReleaseWait": 5, "models"'),
        auto_load=False,
    )
    gpu = FakeGpu(81_920, clock=lambda: lane.clock.now_ns / 1e9)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    a = lane.admit("A")
    await settle()
    pid_a = lane.upstreams.last("A").pid or 0
    gpu.take(pid_a, 60 * GIB)
    lane.upstreams.last("A").load()
    await lane.finish(a)
    gpu.give_back(pid_a, after=1.0)
    b = lane.admit("B")
    await lane.clock.advance(1.05)  # the load waits for A's memory, then starts B
    upstream = lane.upstreams.last("B")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 40 * GIB)
    upstream.load()
    await lane.finish(b)
    db = tmp_path / "log.db"
    write_log(db, [server_started(lane.config, 0, 0), *lane.events()])
    engine = open_database(db)
    try:
        found = explain(engine, b.request_id)
    finally:
        engine.dispose()
    assert found is not None and found.own_swap is not None
    assert found.own_swap.gpu_memory_mib == 40 * GIB
    assert found.own_swap.memory_wait_s is not None and 1.0 <= found.own_swap.memory_wait_s < 1.1
    text = explanation_text(found)
    assert "swap A -> B" in text and "B holds 40.0 GiB" in text and "for GPU memory" in text
