"""The memory router after a model's server ran out of GPU memory (the pure core,
a fake clock): the next load of that model makes room as if it needed the whole
budget, evicting every idle co-resident model first and waiting for a busy one,
until a load of it succeeds and measures it (app/core/residency.py `RanOut`,
docs/scheduling.md "A server out of GPU memory")."""

from __future__ import annotations

import json

import pytest

from app.core import events as ev
from app.core.policy import decide
from app.core.residency import Group, GroupRouter, MemoryRouter, RanOut
from app.runtime.parameters import server_started
from tests.unit.core_driver import T0, CoreDriver
from tests.unit.run_loop_fakes import Lane, config_text, settle
from tools.replay.verify import verify

GIB = 1024
# llama.cpp's line when cudaMalloc fails (as tests/unit/test_out_of_memory.py quotes it).
LINE = (
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 24576.00 MiB on device 0: "
    "cudaMalloc failed: out of memory"
)


def memory_router(side_by_side: bool = False, b_gib: int = 10) -> MemoryRouter:
    # B declares too little: 60 + 10 fit the 80 GiB budget, so B loads beside A.
    return MemoryRouter(
        budget_mib=80 * GIB,
        declared_mib={"A": 60 * GIB, "B": b_gib * GIB},
        side_by_side=side_by_side,
    )


def started(router: MemoryRouter | GroupRouter, at: int = T0) -> ev.ServerStarted:
    return ev.ServerStarted(
        at=at,
        version="test",
        config_hash="",
        scheduler="serial",
        aging_divisor_ns=10**9,
        swap_affinity_bonus=0,
        router=router,
        log_format=ev.LOG_FORMAT,
    )


def driver(router: MemoryRouter | GroupRouter | None = None) -> CoreDriver:
    d = CoreDriver()
    d.apply(started(router or memory_router()))
    return d


def load_for(d: CoreDriver, request_id: str, model: str) -> frozenset[str]:
    """Enqueue `request_id` for `model` and dispatch it with a swap (its swap_started
    recorded): what the decision evicts."""
    d.enqueue(request_id, model)
    decision = decide(d.state, d.now)
    assert decision is not None and decision.dispatched.request_id == request_id
    assert decision.dispatched.swap
    for event in decision.events:
        d.apply(event)
    d.apply(
        ev.SwapStarted(
            at=d.now,
            from_model=None,
            to_model=model,
            request_id=request_id,
            evicted=sorted(decision.evicted),
        )
    )
    for gone in sorted(decision.evicted):
        d.apply(ev.ProcessStopping(at=d.now, model=gone, pid=1, reason="evicted"))
    return decision.evicted


def b_runs_out_beside_a(d: CoreDriver, line: str | None = LINE) -> None:
    """A serves and stays; B loads beside it (the declared sizes fit) and its server
    fails to start out of GPU memory (`line`; None: as a log from before says it)."""
    assert load_for(d, "a1", "A") == frozenset()
    d.finish_swap("A")
    d.complete("a1")
    d.advance(10**9)
    assert load_for(d, "b1", "B") == frozenset()  # beside A: 60 + 10 fit 80
    d.advance(10**9)
    d.apply(
        ev.ProcessStopped(
            at=d.now, model="B", pid=2, reason="failed_start", exit_code=1, out_of_memory=line
        )
    )
    d.apply(ev.SwapFailed(at=d.now, model="B", error="exited", out_of_memory=line))
    d.apply(ev.RequestFailed(at=d.now, request_id="b1", error="out of memory", http_status=503))
    d.advance(10**9)


def test_the_next_load_of_a_model_that_ran_out_beside_an_idle_one_puts_it_away_first() -> None:
    d = driver()
    b_runs_out_beside_a(d)
    assert d.state.ran_out == {"B": RanOut(beside=["A"], loading=True)}
    assert d.state.alone_after_out_of_memory("B") == RanOut(beside=["A"], loading=True)
    assert load_for(d, "b2", "B") == {"A"}


def test_a_log_from_before_says_nothing_of_memory_and_loads_it_beside_again() -> None:
    d = driver()
    b_runs_out_beside_a(d, line=None)
    assert d.state.ran_out == {}
    assert load_for(d, "b2", "B") == frozenset()


@pytest.mark.parametrize("side_by_side", [False, True])
def test_a_busy_neighbour_is_never_stopped_for_it_it_waits_and_takes_no_new_work(
    side_by_side: bool,
) -> None:
    d = driver(memory_router(side_by_side=side_by_side))
    b_runs_out_beside_a(d)
    d.enqueue("a2", "A")
    (running,) = d.dispatch_all()  # A is resident: no swap
    assert running == "a2"
    d.advance(10**9)
    d.enqueue("b2", "B")
    d.advance(10**9)
    d.enqueue("a3", "A")  # after b2: A drains for it
    assert decide(d.state, d.now) is None  # B waits for A's request; A takes no new work
    d.advance(10**9)
    d.complete("a2")
    decision = decide(d.state, d.now)
    assert decision is not None
    assert (decision.dispatched.request_id, decision.evicted) == ("b2", {"A"})


def test_a_load_that_succeeds_and_measures_it_goes_back_to_sharing() -> None:
    d = driver()
    b_runs_out_beside_a(d)
    load_for(d, "b2", "B")
    d.apply(ev.SwapFinished(at=d.now, model="B", duration_ms=500.0, gpu_memory_mib=15 * GIB))
    d.complete("b2")
    assert d.state.ran_out == {}
    assert load_for(d, "a2", "A") == frozenset()  # 60 + 15 measured fit 80: they share again


def test_a_load_that_succeeds_unmeasured_keeps_it_of_unknown_size() -> None:
    # No telemetry: B's declared 10 GiB proved too small and nothing replaces it.
    d = driver()
    b_runs_out_beside_a(d)
    load_for(d, "b2", "B")
    d.finish_swap("B")
    d.complete("b2")
    assert "B" in d.state.ran_out
    assert load_for(d, "a2", "A") == {"B"}  # a resident model of unknown size makes room
    d.finish_swap("A")
    d.complete("a2")
    assert load_for(d, "b3", "B") == {"A"}  # and it loads alone


def test_a_reload_that_declares_a_new_size_for_it_trusts_that_size() -> None:
    d = driver()
    b_runs_out_beside_a(d)
    bigger = memory_router(b_gib=15)
    d.apply(ev.ConfigReloaded(at=d.now, config_hash="2", parameters=started(bigger, d.now)))
    assert d.state.ran_out == {}
    assert load_for(d, "b2", "B") == frozenset()
    # A reload that leaves its size as it was forgets nothing.
    d2 = driver()
    b_runs_out_beside_a(d2)
    same = started(memory_router(), d2.now)
    d2.apply(ev.ConfigReloaded(at=d2.now, config_hash="2", parameters=same))
    assert load_for(d2, "b2", "B") == {"A"}


def test_a_server_that_dies_out_of_memory_while_it_runs_loads_alone_next() -> None:
    d = driver()
    load_for(d, "a1", "A")
    d.finish_swap("A")
    d.complete("a1")
    load_for(d, "b1", "B")
    d.finish_swap("B")
    d.apply(
        ev.ProcessStopped(
            at=d.now, model="B", pid=2, reason="crashed", exit_code=1, out_of_memory=LINE
        )
    )
    d.apply(ev.RequestFailed(at=d.now, request_id="b1", error="out of memory", http_status=503))
    assert d.state.ran_out == {"B": RanOut(beside=["A"], loading=False)}
    assert load_for(d, "b2", "B") == {"A"}


def test_a_restart_forgets_it_as_it_forgets_failed_loads() -> None:
    d = driver()
    b_runs_out_beside_a(d)
    d.apply(started(memory_router(), d.now))
    assert d.state.ran_out == {}


def test_other_routers_decide_as_before() -> None:
    lane = GroupRouter(groups=(Group(name="all", members=("A", "B"), swap=False),))
    d = driver(lane)
    b_runs_out_beside_a(d)
    assert d.state.alone_after_out_of_memory("B") is None
    assert load_for(d, "b2", "B") == frozenset()


def test_why_it_put_them_away_first() -> None:
    at_load = RanOut(beside=["A"], loading=True)
    assert at_load.why("B", ["A"]) == (
        "B ran out of GPU memory at its last load beside A: A was put away first"
    )
    running = RanOut(beside=["A", "C"], loading=False)
    assert running.why("B", ["A", "C"]) == (
        "B ran out of GPU memory while it ran beside A and C: A and C were put away first"
    )
    alone = RanOut(beside=[], loading=True)
    assert alone.why("B", ["C"]) == (
        "B ran out of GPU memory at its last load: C was put away first"
    )


# -- the run loop (the real Scheduler, fake upstreams and clock) ---------------------


async def test_the_run_loop_waits_for_the_busy_neighbour_then_puts_it_away() -> None:
    models = {"A": {"gpuMemory": "60GiB"}, "B": {"gpuMemory": "10GiB"}}
    router = {"use": "memory", "settings": {"memory": {"budget": "80GiB"}}}
    text = json.dumps(json.loads(config_text(models, router=router)) | {"loadBackoff": 0})
    lane = Lane(text, auto_load=False)
    a1 = lane.admit("A")
    await settle()
    lane.upstreams.last("A").load()
    await lane.finish(a1)
    b1 = lane.admit("B")
    await settle()
    failing = lane.upstreams.last("B")
    failing.out_of_memory = LINE
    failing.fail("exited with code 1 during start")
    await settle()
    assert lane.ended(b1).http_status == 503
    a2 = lane.admit("A")  # A is resident: it runs at once
    await settle()
    assert a2.ready.done()
    lane.scheduler.started(a2.request_id)
    b2 = lane.admit("B")
    await lane.clock.advance(1.0)
    assert not b2.ready.done()  # B waits for A's request; A is not stopped under it
    assert not lane.events(ev.ProcessStopping)
    assert [e.to_model for e in lane.events(ev.SwapStarted)] == ["A", "B"]
    lane.scheduler.completed(a2.request_id, 200)
    await settle()
    last = lane.events(ev.SwapStarted)[-1]
    assert (last.to_model, last.evicted) == ("B", ["A"])
    assert last.ran_out == RanOut(beside=["A"], loading=True)
    (stopping,) = lane.events(ev.ProcessStopping)
    assert (stopping.model, stopping.reason) == ("A", "evicted")
    lane.upstreams.last("B").load()
    await lane.finish(b2)
    result = verify(enumerate([server_started(lane.config, 0, 0), *lane.events()], start=1))
    assert result.ok, result.divergence and result.divergence.describe()
