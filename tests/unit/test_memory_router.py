"""The memory router (`routing.router.use: memory`): the eviction rule as a pure
function (app/core/residency.py), its config, and the run loop under it: models
that fit stay loaded, one job at a time on the GPU, and footprints that do not
fit decide exactly as one model at a time."""

from __future__ import annotations

from typing import Any

import pytest

from app.config import ConfigError, parse_config
from app.config.checks import Issues
from app.config.raw import RawConfig
from app.config.routers import resolve_router
from app.core import events as ev
from app.core.residency import MemoryRouter, MemoryView, memory_evictions, to_evict
from app.core.state import SchedulerState, apply
from app.runtime.memory_history import with_history
from app.runtime.parameters import server_started
from tests.unit.run_loop_fakes import Lane, config_text, settle
from tools.replay.verify import verify

GIB = 1024


def router(budget_gib: int = 80, **sizes_gib: int) -> MemoryRouter:
    return MemoryRouter(
        budget_mib=budget_gib * GIB, declared_mib={m: g * GIB for m, g in sizes_gib.items()}
    )


# -- the rule ------------------------------------------------------------------------


def test_a_model_that_fits_loads_beside_the_resident_ones() -> None:
    r = router(80, A=30, B=30, C=10)
    assert memory_evictions(r, "C", {"A", "B"}) == frozenset()
    assert memory_evictions(r, "A", {"A", "B"}) == frozenset()  # in use already


def test_a_model_of_unknown_size_loads_alone() -> None:
    r = router(80, A=10, B=10)
    assert memory_evictions(r, "X", {"A", "B"}) == {"A", "B"}
    # ...and a resident one of unknown size makes room for any load.
    assert memory_evictions(r, "A", {"X", "B"}) == {"X"}


def test_a_model_larger_than_the_budget_loads_alone() -> None:
    assert memory_evictions(router(80, A=90, B=10), "A", {"B"}) == {"B"}


def test_the_cheapest_to_bring_back_goes_first_then_the_least_recently_used() -> None:
    r = router(80, A=30, B=30, C=30)
    view = MemoryView(costs_ns={"A": 9, "B": 5})
    assert memory_evictions(r, "C", {"A", "B"}, view) == {"B"}
    same = MemoryView(costs_ns={"A": 5, "B": 5}, last_used_ns={"A": 1, "B": 2})
    assert memory_evictions(r, "C", {"A", "B"}, same) == {"A"}


def test_never_one_a_waiting_request_needs_when_another_makes_room() -> None:
    r = router(80, A=30, B=30, C=30)
    view = MemoryView(costs_ns={"A": 1, "B": 9}, needed=frozenset({"A"}))
    assert memory_evictions(r, "C", {"A", "B"}, view) == {"B"}
    # When only the needed one makes room, it goes.
    r2 = router(80, A=40, B=5, C=50)
    assert memory_evictions(r2, "C", {"A", "B"}, MemoryView(needed=frozenset({"A"}))) == {"A"}


def test_an_idle_model_goes_before_a_busy_one() -> None:
    r = router(80, A=30, B=30, C=30)
    view = MemoryView(costs_ns={"A": 1, "B": 9}, busy=frozenset({"A"}))
    assert memory_evictions(r, "C", {"A", "B"}, view) == {"B"}


def test_a_small_eviction_made_unneeded_by_a_bigger_one_is_kept() -> None:
    # D (cheap, 10) is taken first, then A (40) makes room alone: D stays.
    r = router(80, A=40, D=10, B=20, C=45)
    view = MemoryView(costs_ns={"D": 1, "A": 2, "B": 3})
    assert memory_evictions(r, "C", {"A", "B", "D"}, view) == {"A"}


def test_measured_sizes_replace_declared_ones() -> None:
    r = router(80, A=30, B=30)
    assert memory_evictions(r, "B", {"A"}, MemoryView(measured_mib={"A": 60 * GIB})) == {"A"}


# -- config --------------------------------------------------------------------------


def memory_config(budget: Any = "80GiB", **models: str) -> str:
    return config_text(
        {m: {"gpuMemory": size} for m, size in models.items()},
        router={"use": "memory", "settings": {"memory": {"budget": budget}}},
        swapAffinityBonus=0,  # arrival order: a mixed run asks for a swap each time
    )


def test_the_config_gives_the_budget_and_each_declared_size() -> None:
    config = parse_config(memory_config("80GiB", A="30GiB", B="30GiB"))
    assert config.router == MemoryRouter(
        budget_mib=80 * GIB, declared_mib={"A": 30 * GIB, "B": 30 * GIB}
    )


def test_auto_without_telemetry_says_to_give_a_size() -> None:
    issues = Issues()
    raw = parse_raw({"routing": {"router": {"use": "memory"}}})
    resolve_router(raw, {}, issues, lambda n, o: n, gpu_total_mib=lambda: None)
    assert issues.errors == [
        "routing.router.settings.memory.budget: 'auto' needs GPU telemetry (NVML, an NVIDIA "
        "driver) and there is none here; give a size instead, e.g. budget: 80GiB"
    ]


def test_auto_is_the_gpu_total_less_the_reserve() -> None:
    issues = Issues()
    raw = parse_raw({"routing": {"router": {"use": "memory"}}})
    found = resolve_router(raw, {}, issues, lambda n, o: n, gpu_total_mib=lambda: 143_771)
    assert isinstance(found, MemoryRouter) and found.budget_mib == 143_771 - 2048
    raw = parse_raw(
        {"routing": {"router": {"use": "memory", "settings": {"memory": {"reserve": "10GiB"}}}}}
    )
    found = resolve_router(raw, {}, Issues(), lambda n, o: n, gpu_total_mib=lambda: 143_771)
    assert isinstance(found, MemoryRouter) and found.budget_mib == 143_771 - 10 * GIB


def parse_raw(data: dict[str, Any]) -> RawConfig:
    import msgspec

    return msgspec.convert(data, RawConfig)


@pytest.mark.parametrize("budget", ["80", "lots", 80])
def test_a_budget_without_a_unit_is_an_error_naming_the_key(budget: Any) -> None:
    with pytest.raises(ConfigError, match="routing.router.settings.memory.budget"):
        parse_config(memory_config(budget, A="30GiB"))


def test_the_start_records_sizes_and_load_times_from_the_log() -> None:
    config = parse_config(memory_config("80GiB", A="30GiB"))
    started = with_history(
        server_started(config, 1, 2), {"A": 31_000}, [("A", 4000.0), ("A", 6000.0), ("A", 5000.0)]
    )
    assert isinstance(started.router, MemoryRouter)
    assert (started.router.measured_mib, started.router.load_ns) == ({"A": 31_000}, {"A": 5e9})
    assert ev.decode(ev.encode(started)) == started
    state = SchedulerState()
    apply(state, started)
    assert state.load_cost_ns == {"A": 5_000_000_000}
    assert to_evict(state.router, "A", frozenset({"B"})) == {"B"}  # B: unknown size


# -- the run loop --------------------------------------------------------------------


def swaps(lane: Lane) -> list[tuple[str, list[str] | None]]:
    return [(e.to_model, e.evicted) for e in lane.events(ev.SwapStarted)]


async def mixed_run(lane: Lane) -> None:
    """A B A B A B, then everything served one at a time."""
    for model in "ABABAB":
        lane.admit(model)
    await lane.serve_all()


async def test_two_models_that_fit_load_once_each_and_are_not_swapped_again() -> None:
    lane = Lane(memory_config("80GiB", A="30GiB", B="30GiB"))
    await mixed_run(lane)
    assert swaps(lane) == [("A", []), ("B", [])]
    assert not lane.events(ev.ProcessStopping)
    assert lane.scheduler.residents == ["A", "B"]
    result = verify(enumerate([server_started(lane.config, 0, 0), *lane.events()], start=1))
    assert result.ok and result.decisions == 6


async def test_co_resident_models_still_run_one_job_at_a_time() -> None:
    lane = Lane(memory_config("80GiB", A="30GiB", B="30GiB"))
    for model in "AB":
        await lane.finish(lane.admit(model))
    a = lane.admit("A")
    b = lane.admit("B")
    await settle()
    assert a.ready.done() and not b.ready.done()  # B is resident, yet waits for A's job
    assert lane.scheduler.state.running_on("B") == 0
    await lane.finish(a)
    assert b.ready.done()
    await lane.finish(b)


async def test_side_by_side_lets_them_run_together() -> None:
    text = config_text(
        {"A": {"gpuMemory": "30GiB"}, "B": {"gpuMemory": "30GiB"}},
        router={"use": "memory", "settings": {"memory": {"budget": "80GiB", "sideBySide": True}}},
    )
    lane = Lane(text)
    for model in "AB":
        await lane.finish(lane.admit(model))
    a = lane.admit("A")
    b = lane.admit("B")
    await settle()
    assert a.ready.done() and b.ready.done()
    await lane.finish(a)
    await lane.finish(b)


def decisions(lane: Lane) -> list[tuple[str, str, bool]]:
    ids = {e.request_id: i for i, e in enumerate(lane.events(ev.RequestEnqueued))}
    return [(str(ids[e.request_id]), e.model, e.swap) for e in lane.events(ev.RequestDispatched)]


@pytest.mark.parametrize("sizes", [("50GiB", "50GiB"), ("30GiB", None)])
async def test_footprints_that_do_not_fit_decide_as_one_model_at_a_time(
    sizes: tuple[str | None, str | None],
) -> None:
    keys = {m: ({} if s is None else {"gpuMemory": s}) for m, s in zip("AB", sizes, strict=True)}
    memory_router = {"use": "memory", "settings": {"memory": {"budget": "80GiB"}}}
    memory = Lane(config_text(keys, router=memory_router, swapAffinityBonus=0))
    single = Lane(config_text(keys, swapAffinityBonus=0))
    for lane in (memory, single):
        await mixed_run(lane)
    assert decisions(memory) == decisions(single)
    assert [s[0] for s in swaps(memory)] == [s[0] for s in swaps(single)] == list("ABABAB")


async def test_a_measured_footprint_lets_a_model_of_unknown_size_share_later() -> None:
    from app.runtime.gpu import FakeGpu, GpuMemory

    lane = Lane(
        config_text(
            {"A": {}, "B": {"gpuMemory": "30GiB"}},
            router={"use": "memory", "settings": {"memory": {"budget": "80GiB"}}},
        ),
        auto_load=False,
    )
    gpu = FakeGpu(81_920)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    a = lane.admit("A")
    await settle()
    upstream = lane.upstreams.last("A")
    assert upstream.pid is not None
    gpu.take(upstream.pid, 20 * GIB)
    upstream.load()
    await lane.finish(a)
    b = lane.admit("B")
    await settle()
    lane.upstreams.last("B").load()
    await lane.finish(b)
    assert swaps(lane) == [("A", []), ("B", [])]  # A measured 20 GiB: B fits beside it


# -- memory other processes hold ------------------------------------------------------


def test_memory_other_processes_hold_is_taken_off_the_budget() -> None:
    r = router(80, A=40, B=35)
    assert memory_evictions(r, "B", {"A"}) == frozenset()
    assert memory_evictions(r, "B", {"A"}, MemoryView(others_mib=10 * GIB)) == {"A"}


async def test_what_another_program_takes_on_the_gpu_is_recorded_and_counts() -> None:
    from app.runtime.gpu import FakeGpu, GpuMemory

    lane = Lane(memory_config("80GiB", A="40GiB", B="35GiB"))
    gpu = FakeGpu(81_920, clock=lambda: lane.clock.now_ns / 1e9)
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    lane.scheduler.swaps.others.start()
    await lane.finish(lane.admit("A"))
    pid_a = lane.upstreams.last("A").pid or 0
    gpu.take(pid_a, 40 * GIB)
    gpu.others_mib = 10 * GIB  # another program takes 10 GiB of the GPU
    await lane.clock.advance(2.0)
    (seen,) = lane.events(ev.GpuMemorySeen)
    assert seen.others_mib == 10 * GIB
    b = lane.admit("B")
    await settle()
    gpu.give_back(pid_a)  # A was evicted: its memory comes back, B's load goes on
    await lane.clock.advance(0.2)
    await lane.finish(b)
    assert swaps(lane) == [("A", []), ("B", ["A"])]  # 40 + 35 fit 80, not 70
    gpu.others_mib = 0
    await lane.clock.advance(2.0)
    assert [e.others_mib for e in lane.events(ev.GpuMemorySeen)] == [10 * GIB, 0]
    await lane.finish(lane.admit("A"))
    assert swaps(lane)[-1] == ("A", [])  # room again: A loads beside B
    log = [server_started(lane.config, 0, 0), *lane.events()]
    assert verify(enumerate(log, start=1)).ok
