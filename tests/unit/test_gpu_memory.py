"""GPU telemetry (app/runtime/gpu.py): the port's contract over the fake GPU and
NVML (where a driver is present), footprints measured by pids or by growth,
recorded when a model becomes ready and when it stops, declared `gpuMemory`,
and the `/metrics` gauges."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from app.config import ConfigError, parse_config
from app.core import events as ev
from app.runtime.gpu import FakeGpu, GpuMemory, GpuSnapshot, GpuTelemetry
from app.runtime.gpu_file import FileGpu
from app.runtime.gpu_nvml import open_nvml
from tests.unit.run_loop_fakes import Lane, config_text, settle

# -- the port's contract: every telemetry answers the same way ----------------------


@pytest.fixture(params=["fake", "files", "nvml"])
def telemetry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GpuTelemetry]:
    if request.param == "fake":
        gpu = FakeGpu(81_920)
        gpu.take(os.getpid(), 1_000)
        yield gpu
        return
    if request.param == "files":
        (tmp_path / f"{os.getpid()}.json").write_text('{"mib": 1000}')
        yield FileGpu(tmp_path, 81_920)
        return
    nvml = open_nvml()
    if nvml is None:
        pytest.skip("no NVIDIA driver here: NVML's side of the contract runs on a GPU")
    yield nvml
    nvml.close()


def test_a_snapshot_adds_up(telemetry: GpuTelemetry) -> None:
    snap = telemetry.snapshot()
    assert isinstance(snap, GpuSnapshot)
    assert snap.total_mib > 0
    assert 0 <= snap.used_mib <= snap.total_mib
    assert snap.free_mib == snap.total_mib - snap.used_mib
    assert snap.utilization_pct is None or 0 <= snap.utilization_pct <= 100
    assert all(p.pid > 0 and p.used_mib >= 0 for p in snap.processes)
    assert sum(p.used_mib for p in snap.processes) <= snap.used_mib
    assert snap.held_by([]) is None


def test_what_no_process_of_ours_holds_is_none(telemetry: GpuTelemetry) -> None:
    # A pid that cannot exist (above Linux's pid_max) holds nothing.
    assert telemetry.snapshot().held_by([2**23]) is None


# -- the fake GPUs --------------------------------------------------------------


def test_the_file_gpu_forgets_a_holder_past_its_free_at(tmp_path: Path) -> None:
    import time

    (tmp_path / "7.json").write_text('{"mib": 300}')
    (tmp_path / "8.json").write_text(f'{{"mib": 200, "free_at": {time.time() - 1}}}')
    (tmp_path / "9.json").write_text(f'{{"mib": 100, "free_at": {time.time() + 60}}}')
    snap = FileGpu(tmp_path, 1000).snapshot()
    assert (snap.used_mib, [p.pid for p in snap.processes]) == (400, [7, 9])
    assert not (tmp_path / "8.json").exists()


def test_the_fake_gpu_takes_and_gives_back_memory_after_a_delay() -> None:
    now = [0.0]
    gpu = FakeGpu(1000, clock=lambda: now[0], others_mib=100)
    gpu.take(7, 300)
    gpu.take(8, 200)
    assert (gpu.snapshot().used_mib, gpu.snapshot().held_by([7])) == (600, 300)
    gpu.give_back(8)
    gpu.give_back(7, after=2.0)
    assert gpu.snapshot().used_mib == 400  # 7 still holds its memory after its exit
    now[0] = 1.9
    assert gpu.snapshot().holders([7, 8])[0].pid == 7
    now[0] = 2.0
    assert (gpu.snapshot().used_mib, gpu.snapshot().holders([7])) == (100, [])


# -- footprints ------------------------------------------------------------------


def test_a_footprint_is_its_pids_memory_and_the_most_it_held() -> None:
    gpu = FakeGpu(10_000)
    memory = GpuMemory(gpu)
    memory.before_load("A")
    gpu.take(11, 4_000)
    gpu.take(12, 1_000)  # a child of its server
    assert memory.measure("A", [11, 12]) == 5_000
    gpu.give_back(12)
    assert memory.measure("A", [11]) == 5_000  # the most it held while resident
    assert memory.stopped("A") == 5_000
    assert memory.stopped("A") is None  # forgotten for its next start
    assert memory.footprints == {"A": 5_000}


def test_where_no_pid_matches_the_footprint_is_the_growth_around_its_load() -> None:
    gpu = FakeGpu(10_000, others_mib=500)
    memory = GpuMemory(gpu)
    memory.before_load("A")
    gpu.others_mib = 3_500  # a container: NVML lists no pid of ours
    assert memory.measure("A", [11]) == 3_000


def test_without_telemetry_nothing_is_measured() -> None:
    memory = GpuMemory(None)
    memory.before_load("A")
    assert (memory.snapshot(), memory.measure("A", [1]), memory.stopped("A")) == (None, None, None)


def test_without_a_driver_nvml_is_none_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a driver is present")
    with caplog.at_level(logging.INFO, logger="gpulane.gpu"):
        assert open_nvml() is None
    assert len(caplog.records) == 1 and "no GPU telemetry" in caplog.text


def gpu_lane(gpu_memory: str | None = None) -> tuple[Lane, FakeGpu]:
    keys = {} if gpu_memory is None else {"gpuMemory": gpu_memory}
    lane = Lane(config_text({"A": keys, "B": {}}), auto_load=False)
    gpu = FakeGpu(80_000)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    return lane, gpu


async def test_the_footprint_is_recorded_when_the_model_is_ready_and_when_it_stops() -> None:
    lane, gpu = gpu_lane()
    ticket = lane.admit("A")
    await settle()
    upstream = lane.upstreams.last("A")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 20_000)
    upstream.load()
    await lane.finish(ticket)
    gpu.take(upstream.pid, 4_000)  # it grew after it was ready (a first prompt)
    lane.admit("B")
    await settle()
    (ready,) = lane.events(ev.SwapFinished)[:1]
    assert ready.gpu_memory_mib == 20_000
    (stopping,) = lane.events(ev.ProcessStopping)
    assert (stopping.model, stopping.gpu_memory_mib) == ("A", 24_000)
    (stopped,) = lane.events(ev.ProcessStopped)
    assert stopped.gpu_memory_mib is None  # measured once, when the stop began


async def test_without_telemetry_the_events_carry_no_footprint() -> None:
    lane = Lane(config_text({"A": {}}))
    ticket = lane.admit("A")
    await lane.finish(ticket)
    assert [e.gpu_memory_mib for e in lane.events(ev.SwapFinished)] == [None]


async def test_a_measurement_a_tenth_off_the_declared_size_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lane, gpu = gpu_lane("20GiB")
    ticket = lane.admit("A")
    await settle()
    upstream = lane.upstreams.last("A")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 23_000)  # 20480 declared: 12 % more
    with caplog.at_level(logging.WARNING, logger="gpulane.scheduler"):
        upstream.load()
        await lane.finish(ticket)
    assert "declares gpuMemory 20480 MiB" in caplog.text


async def test_a_measurement_within_a_tenth_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lane, gpu = gpu_lane("20GiB")
    ticket = lane.admit("A")
    await settle()
    upstream = lane.upstreams.last("A")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 21_000)
    with caplog.at_level(logging.WARNING, logger="gpulane.scheduler"):
        upstream.load()
        await lane.finish(ticket)
    assert "gpuMemory" not in caplog.text


# -- gpuMemory in the config ----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "mib"),
    [("24GiB", 24_576), ("24 GiB", 24_576), ("512MiB", 512), ("1.5gib", 1_536), ("80GB", 76_294)],
)
def test_gpu_memory_is_a_size_with_a_unit(given: str, mib: int) -> None:
    config = parse_config(config_text({"A": {"gpuMemory": given}}))
    assert config.models["A"].gpu_memory_mib == mib


@pytest.mark.parametrize("given", ["24", "24G", "lots", "0MiB", 24])
def test_a_gpu_memory_without_a_unit_is_an_error_naming_the_key(given: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config_text({"A": {"gpuMemory": given}}))
    assert "models.A.gpuMemory" in str(caught.value)
    assert "GiB" in str(caught.value) or "at least 1MiB" in str(caught.value)


# -- /metrics ----------------------------------------------------------------------


async def test_metrics_show_the_gpu_and_each_model_footprint() -> None:
    lane, gpu = gpu_lane("20GiB")
    gpu.utilization_pct = 37
    gpu.take(99, 1_024)
    memory = lane.scheduler.swaps.gpu
    lane.scheduler.metrics.watch_gpu(memory, lambda: {"A": 20_480})
    text = generate_latest(lane.scheduler.metrics.registry).decode()
    assert 'gpulane_gpu_memory_total_bytes{gpu="0",name="fake GPU"} 8.388608e+10' in text
    assert 'gpulane_gpu_memory_used_bytes{gpu="0",name="fake GPU"} 1.073741824e+09' in text
    assert "gpulane_gpu_memory_free_bytes" in text
    assert 'gpulane_gpu_utilization_ratio{gpu="0",name="fake GPU"} 0.37' in text
    assert 'gpulane_model_gpu_memory_bytes{model="A"} 2.147483648e+10' in text


# -- memory back before the next load ------------------------------------------------


def held_lane(release_wait: float = 10.0) -> tuple[Lane, FakeGpu]:
    """Two models, one at a time, on a fake GPU that runs on the lane's clock."""
    lane = Lane(
        config_text({"A": {}, "B": {}}, swapAffinityBonus=0).replace(
            '"models"', f'"memoryReleaseWait": {release_wait}, "models"'
        )
    )
    gpu = FakeGpu(81_920, clock=lambda: lane.clock.now_ns / 1e9)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    return lane, gpu


async def a_ran_and_holds(lane: Lane, gpu: FakeGpu, mib: int = 60_000) -> int:
    """A loads (taking `mib`), serves one request, and is left resident."""
    ticket = lane.admit("A")
    await settle()
    pid = lane.upstreams.last("A").pid
    assert pid is not None
    gpu.take(pid, mib)
    await lane.finish(ticket)
    return pid


async def test_a_load_waits_until_the_stopped_model_s_memory_is_back() -> None:
    lane, gpu = held_lane()
    pid = await a_ran_and_holds(lane, gpu)
    gpu.give_back(pid, after=2.0)  # the driver frees it 2 s after the exit
    b = lane.admit("B")
    await settle()
    assert ("start", "B") not in lane.upstreams.calls  # A's process is gone, its memory not
    (waiting,) = lane.events(ev.MemoryWaitStarted)
    assert waiting.model == "B" and waiting.limit_ms == 10_000
    assert waiting.holders == [ev.MemoryHolder(pid=pid, model="A", mib=60_000)]
    await lane.clock.advance(1.9)
    assert ("start", "B") not in lane.upstreams.calls
    await lane.clock.advance(0.2)
    assert ("start", "B") in lane.upstreams.calls
    (ended,) = lane.events(ev.MemoryWaitEnded)
    assert ended.released and 2000 <= ended.waited_ms <= 2100 and ended.holders == []
    await lane.finish(b)
    assert lane.ended(b).http_status == 200


async def test_memory_never_released_fails_the_load_naming_who_holds_it() -> None:
    lane, gpu = held_lane(release_wait=10.0)
    pid = await a_ran_and_holds(lane, gpu)  # and never gives it back
    b = lane.admit("B")
    await settle()
    await lane.clock.advance(10.1)
    (ended,) = lane.events(ev.MemoryWaitEnded)
    assert not ended.released and [h.pid for h in ended.holders] == [pid]
    assert ("start", "B") not in lane.upstreams.calls
    failed = lane.ended(b)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 502
    assert f"GPU memory was not released: pid {pid} (model 'A') still holds 60000 MiB" in (
        failed.error
    )
    (swap_failed,) = lane.events(ev.SwapFailed)
    assert swap_failed.model == "B" and "memoryReleaseWait" in swap_failed.error
    # The lane moves on: the next request for A is served.
    gpu.give_back(pid)
    a = lane.admit("A")
    await settle()
    await lane.finish(a)
    assert lane.ended(a).http_status == 200


async def test_without_telemetry_a_load_does_not_wait() -> None:
    lane = Lane(config_text({"A": {}, "B": {}}))
    await lane.finish(lane.admit("A"))
    b = lane.admit("B")
    await lane.finish(b)
    assert not lane.events(ev.MemoryWaitStarted, ev.MemoryWaitEnded)


def test_memory_release_wait_is_seconds_or_a_duration() -> None:
    assert parse_config(config_text({"A": {}})).memory_release_wait == 10
    text = config_text({"A": {}}).replace('"models"', '"memoryReleaseWait": "30s", "models"')
    assert parse_config(text).memory_release_wait == 30
    with pytest.raises(ConfigError, match="memoryReleaseWait"):
        parse_config(
            config_text({"A": {}}).replace('"models"', '"memoryReleaseWait": -1, "models"')
        )


async def test_the_console_s_memory_status_has_the_gpu_and_each_footprint() -> None:
    lane, gpu = gpu_lane("20GiB")
    gpu.take(99, 1_000)  # another process's
    ticket = lane.admit("B")
    await settle()
    upstream = lane.upstreams.last("B")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 7_000)
    upstream.load()
    await lane.finish(ticket)
    status = lane.scheduler.memory_status()
    assert status.gpu is not None and status.gpu.used_mib == 8_000
    assert status.footprints == {"A": 20_480, "B": 7_000}
    assert (status.measured, status.resident, status.budget_mib) == (frozenset({"B"}), ("B",), None)


async def test_a_load_waiting_for_memory_ends_at_once_when_gpulane_stops() -> None:
    import asyncio

    lane, gpu = held_lane(release_wait=600.0)
    await a_ran_and_holds(lane, gpu)  # and never gives it back
    lane.admit("B")
    await settle()
    assert lane.events(ev.MemoryWaitStarted)
    # No clock moves: the stop itself ends the wait (a bound in case it does not).
    await asyncio.wait_for(lane.scheduler.shutdown(), timeout=30)
    (ended,) = lane.events(ev.MemoryWaitEnded)
    assert not ended.released
    assert ("start", "B") not in lane.upstreams.calls
    (failed,) = lane.events(ev.SwapFailed)
    assert failed.model == "B" and "gpulane is stopping" in failed.error
