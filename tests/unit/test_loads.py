"""The core's answers about loads, stops and a drain (app/core/loads.py,
app/core/drain.py, peers.another_peer_left, SchedulerState.newcomer): what the
run loop asks before it acts, tested like `decide`, with no run loop."""

from __future__ import annotations

from app.core import events as ev
from app.core.drain import after_grace, cancelled_at_stop
from app.core.loads import idle_evictions, plan_load, preload_evictions
from app.core.peers import another_peer_left
from app.core.residency import Group, GroupRouter
from app.core.state import FIFO, SchedulerState, apply
from tests.unit.core_driver import T0, CoreDriver

LANE = GroupRouter(
    groups=(
        Group(name="gpu0", members=("a", "b"), swap=True, exclusive=False),
        Group(name="gpu1", members=("c", "d"), swap=True, exclusive=False),
    )
)


def state_with(
    router: GroupRouter | None, *, concurrency: dict[str, int] | None = None
) -> CoreDriver:
    driver = CoreDriver(concurrency=concurrency)
    driver.apply(
        ev.ServerStarted(
            at=T0,
            version="test",
            config_hash="",
            scheduler="serial",
            aging_divisor_ns=10**9,
            swap_affinity_bonus=0,
            router=router,
            concurrency=concurrency or {},
            log_format=ev.LOG_FORMAT,
        )
    )
    return driver


def load(d: CoreDriver, model: str) -> None:
    """`model` loads, evicting nothing (another lane, or its lane was empty)."""
    d.apply(ev.SwapStarted(at=d.now, from_model=None, to_model=model, evicted=[]))
    d.finish_swap(model)


# -- plan_load --------------------------------------------------------------------


def test_one_model_at_a_time_stops_every_other_process_and_waits_for_every_stop() -> None:
    plan = plan_load(None, "b", ["a"], ["a", "c", "b"], {"x"})
    assert plan.stop == ("a", "c")  # in spawn order, never the target
    assert plan.wait_for == ("a", "c", "x")  # a stop already in progress too


def test_with_a_router_a_load_stops_only_what_it_evicts() -> None:
    plan = plan_load(LANE, "b", ["a"], ["a", "c"], set())
    assert plan.stop == ("a",)
    assert plan.wait_for == ("a",)


def test_a_load_waits_for_a_stop_in_its_lane_but_not_for_one_in_another() -> None:
    plan = plan_load(LANE, "b", [], ["c"], {"a", "d"})
    assert plan.stop == ()
    assert plan.wait_for == ("a",)  # d stops on the other GPU: no need to wait


def test_a_load_waits_for_its_own_previous_process_to_stop() -> None:
    # A hung model restarted: its old process is still stopping.
    plan = plan_load(LANE, "c", [], [], {"c"})
    assert plan.wait_for == ("c",)


def test_an_evicted_model_without_a_process_is_not_stopped() -> None:
    plan = plan_load(LANE, "b", ["a"], [], set())
    assert plan.stop == () and plan.wait_for == ()


# -- idle_evictions, preload_evictions ------------------------------------------


def test_a_load_nobody_planned_evicts_only_idle_models() -> None:
    d = state_with(LANE)
    load(d, "a")
    load(d, "c")
    assert idle_evictions(d.state, "b") == {"a"}
    d.enqueue("r1", "a")
    d.dispatch_all()
    assert d.state.busy("a")
    assert idle_evictions(d.state, "b") == frozenset()  # a is busy: left alone


def test_a_preload_evicts_idle_models_and_never_a_busy_one() -> None:
    d = state_with(LANE)
    load(d, "a")
    assert preload_evictions(d.state, "b") == {"a"}
    assert preload_evictions(d.state, "c") == frozenset()  # another lane
    assert preload_evictions(d.state, "a") is None  # in use already
    d.enqueue("r1", "a")
    d.dispatch_all()
    assert preload_evictions(d.state, "b") is None  # it would evict a busy model


# -- drain ------------------------------------------------------------------------


def test_a_drain_cancels_waiting_synchronous_requests_and_keeps_waiting_jobs() -> None:
    d = state_with(None)
    d.enqueue("running", "a")
    d.dispatch_all()
    assert list(d.state.running) == ["running"]
    for rid, durable in [("sync-1", False), ("job", True), ("sync-2", False)]:
        d.enqueue(rid, "a", durable=durable)
    assert cancelled_at_stop(d.state) == ["sync-1", "sync-2"]


def test_after_the_grace_a_running_job_is_requeued_and_a_synchronous_request_fails() -> None:
    d = state_with(LANE, concurrency={"a": 2})
    d.enqueue("sync", "a")
    d.enqueue("job", "a", durable=True)
    d.dispatch_all()
    assert set(d.state.running) == {"sync", "job"}
    assert dict(after_grace(d.state)) == {"sync": "fail", "job": "requeue"}


# -- peers ------------------------------------------------------------------------


def test_a_failed_probe_retries_on_another_peer_only_if_one_has_not_failed() -> None:
    choices = ["box1/m", "box2/m", "box3/m"]
    assert another_peer_left(choices, "box1/m", set())
    assert another_peer_left(choices, "box1/m", {"box2/m"})
    assert not another_peer_left(choices, "box1/m", {"box2/m", "box3/m"})
    assert not another_peer_left(["box1/m"], "box1/m", set())


# -- newcomer: fifo's rule in one place ------------------------------------------


def test_a_newcomer_queues_at_the_priority_an_enqueue_would_give_it() -> None:
    state = SchedulerState()
    apply(
        state,
        ev.ServerStarted(
            at=T0,
            version="test",
            config_hash="",
            scheduler=FIFO,
            aging_divisor_ns=10**9,
            swap_affinity_bonus=0,
            model_priority={"m": 7},
        ),
    )
    arriving = state.newcomer("m", 3, T0)
    apply(
        state,
        ev.RequestEnqueued(
            at=T0,
            request_id="r",
            model="m",
            model_requested="m",
            endpoint="",
            priority=3,
            band="normal",
        ),
    )
    (queued,) = state.queue
    assert arriving.priority == queued.priority == 10
    assert arriving.order == queued.order


def test_an_unload_cuts_off_only_what_runs_on_its_model() -> None:
    d = state_with(LANE)
    d.enqueue("on-a", "a", durable=True)
    d.enqueue("on-c", "c")
    d.dispatch_all()
    assert set(d.state.running) == {"on-a", "on-c"}
    assert after_grace(d.state, "a") == [("on-a", "requeue")]
    assert after_grace(d.state, "c") == [("on-c", "fail")]
