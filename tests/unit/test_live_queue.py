"""The live queue view (app/report/live_queue.py): estimated starts follow the
queue's own dispatch order, and a window of the view is that slice of the whole
view, so the console can ask for one page of 10,000 waiting requests."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from app.core import events as ev
from app.core.queue import Queued
from app.core.residency import Group, GroupRouter
from app.core.run_estimate import Durations, RunEstimates
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from app.report.live_queue import SLICE, estimate_starts, queue_view, queue_view_steps
from app.report.run_times import RunTimes, recent_by_model
from app.runtime.admission import estimated_wait_s
from app.web.console.queue_page import page_window, queue_page
from tests.unit.core_driver import CoreDriver

TIMES = RunTimes({"a": 5.0, "b": 60.0, "c": 240.0}, {"a": 2.0, "b": 20.0, "c": 30.0}, 5.0, 1.0)


def busy_state(params: ScoringParams, n: int = 300, seed: int = 1) -> SchedulerState:
    rng = random.Random(seed)
    driver = CoreDriver(params, resident="a")
    driver.enqueue("running", "a", 0, caller="x")
    driver.step()
    for i in range(n):
        driver.advance(rng.randrange(5) * NS_PER_S)
        driver.enqueue(
            f"r{i}",
            rng.choice("abc"),
            rng.choice((100, 102, 0, 1, -100)),
            caller=rng.choice(["x", "y", "z", None]),
            expected_run_ns=rng.choice((None, 6 * NS_PER_S, 60 * NS_PER_S, 600 * NS_PER_S)),
        )
    return driver.state


def reference_starts(state: SchedulerState, now: int) -> dict[str, int]:
    """Drain a copy of the queue with `best`, switching the resident as it goes,
    each request taking its own expected run (else its model's median)."""
    copy = state.queue.empty_copy()
    for q in state.queue:
        copy.push(q)
    resident = state.loading or state.resident
    fair = state.fair_keys()
    t, starts = now + int(TIMES.run("a") * NS_PER_S), {}
    while (item := copy.best(resident, fair)) is not None:
        if item.model != resident:
            t += int(TIMES.swap(item.model) * NS_PER_S)
            resident = item.model
        starts[item.request_id] = t
        # its own learnt run time, else its model's
        t += item.expected_run_ns or int(TIMES.run(item.model) * NS_PER_S)
        copy.remove(item.request_id)
    return starts


PARAMS = [
    ScoringParams(),
    ScoringParams(swap_affinity_bonus=40),
    ScoringParams(fair_share_bonus=20, short_job_bonus=20),
]


@pytest.mark.parametrize("params", PARAMS)
def test_estimated_starts_follow_the_queues_own_dispatch_order(params: ScoringParams) -> None:
    state = busy_state(params)
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    assert estimate_starts(state, running_since, now, TIMES) == reference_starts(state, now)
    some = ["r7", "r150", "r299"]
    partial = estimate_starts(state, running_since, now, TIMES, some)
    full = reference_starts(state, now)
    assert all(partial[rid] == full[rid] for rid in some)
    assert len(partial) < len(full) or set(some) >= set(full)


def test_estimated_starts_fill_the_free_slots_then_drain_for_another_model() -> None:
    d = CoreDriver(ScoringParams(), resident="a", concurrency={"a": 3})
    d.enqueue("running", "a")
    d.step()
    for rid in ("a0", "a1", "a2", "a3"):
        d.enqueue(rid, "a")
    d.enqueue("b0", "b", -100)
    now, s = d.now, NS_PER_S
    starts = estimate_starts(d.state, {"running": now}, now, TIMES)
    # two slots free now, the third when `running` ends (5 s); then as they free;
    # b waits for all three to drain (10 s), then its 20 s load
    assert {rid: (t - now) // s for rid, t in starts.items()} == {
        "a0": 0,
        "a1": 0,
        "a2": 5,
        "a3": 5,
        "b0": 30,
    }


@pytest.mark.parametrize("params", PARAMS)
def test_a_window_of_the_view_is_that_slice_of_the_whole(params: ScoringParams) -> None:
    state = busy_state(params)
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    whole = queue_view(state, running_since, now, TIMES)
    assert whole.total_waiting == len(whole.waiting) == 300
    assert sum(whole.waiting_by_model.values()) == 300
    for first, count in [(0, 100), (99, 101), (250, 100), (300, 10)]:
        window = queue_view(state, running_since, now, TIMES, first=first, count=count)
        assert window.waiting == whole.waiting[first : first + count]
        assert window.total_waiting == 300
        assert window.waiting_by_model == whole.waiting_by_model


def test_the_console_page_from_a_window_is_the_page_from_the_whole_view() -> None:
    state = busy_state(ScoringParams(fair_share_bonus=20, short_job_bonus=20))
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    whole = queue_view(state, running_since, now, TIMES)
    for offset, limit in [(0, 100), (1, 50), (100, 100), (290, 100)]:
        first, count = page_window(offset, limit)
        window = queue_view(state, running_since, now, TIMES, first=first, count=count)
        assert queue_page(window, offset, limit) == queue_page(whole, offset, limit)


def test_a_user_keys_page_from_its_own_rows_is_its_page_from_the_whole_view() -> None:
    # A user key's view lists only its rows and the one ahead of each, not 10k others.
    state = busy_state(ScoringParams(fair_share_bonus=20, short_job_bonus=20))
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    whole = queue_view(state, running_since, now, TIMES)
    for caller in ["x", "y", "nobody"]:
        own = queue_view(state, running_since, now, TIMES, caller=caller)
        mine = [w for w in whole.waiting if w.caller == caller]
        assert len(own.waiting) <= 2 * len(mine) < len(whole.waiting)
        assert own.total_waiting == whole.total_waiting
        for offset, limit in [(0, 100), (3, 10), (70, 100)]:
            page = queue_page(own, offset, limit, caller)
            assert page == queue_page(whole, offset, limit, caller)
            assert page["waiting"] or offset >= len(mine)


@pytest.mark.parametrize("params", PARAMS)
def test_the_view_lists_the_simulated_order_after_cancels_below_the_tops(
    params: ScoringParams,
) -> None:
    # The view walks the lanes' heaps in place (no copy, no sort): entries cancelled
    # below a heap's top stay in it, dead, and must be skipped, their children not.
    rng = random.Random(2)
    driver = CoreDriver(params, resident="a")
    driver.enqueue("running", "a", 0, caller="x")
    driver.step()
    # 1,200 over 2 models: lanes past the walk's lazy part (its sorted rest)
    for i in range(1200):
        driver.advance(rng.randrange(3) * NS_PER_S)
        driver.enqueue(
            f"r{i}", rng.choice("ab"), rng.choice((100, 0, -100)), caller=rng.choice("xy")
        )
    for i in rng.sample(range(1200), 400):
        driver.cancel(f"r{i}")
    state = driver.state
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    whole = queue_view(state, running_since, now, TIMES)
    # One order: the rows are the simulated dispatch's (the reference drain's), so
    # on one lane no row starts before the row above it.
    reference = reference_starts(state, now)
    assert [w.request_id for w in whole.waiting] == list(reference)
    assert estimate_starts(state, running_since, now, TIMES) == reference
    starts = [w.estimated_start_at for w in whole.waiting]
    assert starts == sorted(starts)
    window = queue_view(state, running_since, now, TIMES, first=10, count=20)
    assert window.waiting == whole.waiting[10:30]


@pytest.mark.parametrize("params", PARAMS)
def test_the_view_in_slices_of_a_snapshot_is_the_view_while_the_state_moves_on(
    params: ScoringParams,
) -> None:
    # The web layer computes a whole view in slices on the run loop, between its
    # other work: of a snapshot, which the run loop's changes do not reach.
    rng = random.Random(3)
    driver = CoreDriver(params, resident="a")
    driver.enqueue("running", "a", 0, caller="x")
    driver.step()
    for i in range(3 * SLICE):
        driver.advance(rng.randrange(3) * NS_PER_S)
        driver.enqueue(
            f"r{i}", rng.choice("abc"), rng.choice((100, 0, -100)), caller=rng.choice("xy")
        )
    state = driver.state
    now = max(q.enqueued_ns for q in state.queue)
    running_since = dict.fromkeys(state.running, now)
    for kw in ({}, {"caller": "y"}, {"first": 5, "count": 2 * SLICE}):
        expected = queue_view(state, running_since, now, TIMES, **kw)
        steps = queue_view_steps(state.snapshot(), dict(running_since), now, TIMES, **kw)
        slices = 0
        while True:
            try:
                next(steps)
            except StopIteration as done:
                assert done.value == expected
                break
            slices += 1
            # the run loop moves on between slices
            driver.complete(next(iter(state.running)))
            driver.step()
            driver.cancel(rng.choice([q.request_id for q in state.queue]))
            driver.enqueue(f"late{slices}{kw}", "c", 100, caller="y")
        assert slices >= 2
        now = max(q.enqueued_ns for q in state.queue)
        running_since = dict.fromkeys(state.running, now)


def two_lanes(slots_a: int = 2) -> CoreDriver:
    """Lanes gpu0 (A, B: one at a time) and gpu1 (C); A has `slots_a` slots."""
    d = CoreDriver(ScoringParams(), concurrency={"A": slots_a})
    router = GroupRouter(
        groups=(
            Group(name="gpu0", members=("A", "B"), exclusive=False),
            Group(name="gpu1", members=("C",), exclusive=False),
        )
    )
    d.apply(msgspec.structs.replace(d.log[0], router=router))
    d.load("C")
    d.enqueue("warm", "A")  # A's load, by the dispatch rule (C stays: another lane)
    assert d.step() is not None
    d.finish_swap("A")
    d.complete("warm")
    assert d.state.in_use == {"A", "C"} and not d.state.loads
    return d


TIMES_NS = Durations(
    {"A": 60 * NS_PER_S, "B": 30 * NS_PER_S, "C": 10 * NS_PER_S},
    {"A": 20 * NS_PER_S, "B": 40 * NS_PER_S, "C": 5 * NS_PER_S},
)


def test_lanes_run_side_by_side_and_a_swap_in_a_lane_waits_for_its_drain() -> None:
    d = two_lanes()
    for rid, model in (("a0", "A"), ("a1", "A"), ("c0", "C")):
        d.enqueue(rid, model)
        assert d.step() is not None
    running_since = dict.fromkeys(d.state.running, d.now)
    for rid, model, priority in (
        ("a2", "A", 0),
        ("c1", "C", 0),
        ("b0", "B", -100),
        ("c2", "C", -100),
    ):
        d.enqueue(rid, model, priority)
    starts = estimate_starts(d.state, running_since, d.now, TIMES_NS)
    in_s = {rid: (t - d.now) // NS_PER_S for rid, t in starts.items()}
    # a2 on A's first free slot (60 s); C's lane beside it: c1 when c0 ends (10 s),
    # c2 after c1 (20 s), whatever runs on A; B waits for A to drain (a2 ends at
    # 120 s), then its 40 s load.
    assert in_s == {"a2": 60, "c1": 10, "b0": 160, "c2": 20}


@pytest.mark.parametrize("slots_a", [1, 2, 3])
def test_retry_after_and_the_live_queue_agree_on_the_same_request(slots_a: int) -> None:
    """Retry-After for a request refused now is the start the live queue gives that
    same request once queued (whole seconds, rounded up), with slots and lanes."""
    rng = random.Random(slots_a)
    d = two_lanes(slots_a)
    for i in range(slots_a):
        d.enqueue(f"run{i}", "A", expected_run_ns=rng.randrange(5, 90) * NS_PER_S)
        d.step()
    d.enqueue("runc", "C")
    d.step()
    running_since = dict.fromkeys(d.state.running, d.now)
    for i in range(40):
        d.advance(rng.randrange(3) * NS_PER_S)
        d.enqueue(
            f"w{i}",
            rng.choice("ABC"),
            rng.choice((100, 0, -100)),
            expected_run_ns=rng.choice((None, 7 * NS_PER_S, 45 * NS_PER_S)),
        )
    d.advance(NS_PER_S // 3)
    for model, priority in (("A", 0), ("B", -100), ("C", 100), ("B", 100)):
        arriving = d.state.newcomer(model, priority, d.now, expected_run_ns=9 * NS_PER_S)
        told = estimated_wait_s(d.state, arriving, running_since, d.now, TIMES_NS)
        state = d.state.snapshot()
        apply(state, _enqueued(arriving))
        view = queue_view(state, running_since, d.now, TIMES_NS)
        (row,) = [w for w in view.waiting if w.request_id == "newcomer"]
        assert told == max(1, math.ceil(row.estimated_start_in_s)), (model, priority)


def _enqueued(q: Queued) -> ev.RequestEnqueued:
    return ev.RequestEnqueued(
        at=q.enqueued_ns,
        request_id="newcomer",
        model=q.model,
        model_requested=q.model,
        endpoint=q.endpoint,
        priority=q.priority,
        band="normal",
        expected_run_ns=q.expected_run_ns,
    )


def test_an_overrunning_job_is_measured_against_its_models_longer_runs() -> None:
    # Its model's last runs took 10-50 s (median 30 s). Past 30 s, what is known
    # is the runs that lasted longer: it ends at their median; past the longest
    # (50 s), its end is open, and the start behind it is the earliest it can be.
    learnt = RunEstimates()
    for seconds in (10, 20, 30, 40, 50):
        learnt.observe("m", "/v1/chat/completions", seconds * NS_PER_S)
    times = learnt.durations()
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    driver.enqueue("long", "m", 0)
    driver.step()
    running_since = {"long": driver.now}
    driver.enqueue("next", "m", 0)
    seen = []
    for ran in (5, 35, 45, 55, 90):
        now = running_since["long"] + ran * NS_PER_S
        view = queue_view(driver.state, running_since, now, times)
        ((running,), (entry,)) = view.running, view.waiting
        assert running.expected_end_at is not None and running.expected_end_at >= now / NS_PER_S
        assert entry.estimated_start_open == running.expected_end_open
        assert entry.estimated_start_at == running.expected_end_at
        since = running_since["long"] / NS_PER_S
        seen.append((running.expected_end_at - since, running.expected_end_open))
    # Ends at +30 (its median), +40 and +50 (the median of the longer runs), then
    # not known: "at least now", never "as long again as it has run" (+110, +180).
    assert seen == [(30.0, False), (40.0, False), (50.0, False), (55.0, True), (90.0, True)]


def test_a_render_reporting_progress_is_expected_to_end_as_its_progress_says() -> None:
    # Its model's renders took 30 s (median). This one reports 5 of 20 steps done
    # 20 s in: a quarter in 20 s, so 80 s in all, whatever its past runs said;
    # the start behind it follows.
    learnt = RunEstimates()
    learnt.observe("comfy", "/prompt", 30 * NS_PER_S)
    times = learnt.durations()
    driver = CoreDriver(ScoringParams(0, 0), resident="comfy")
    driver.enqueue("render", "comfy", 0)
    driver.step()
    since = driver.now
    running_since = {"render": since}
    driver.enqueue("next", "comfy", 0)

    def ends(at_s: int) -> tuple[float, float, bool, tuple[int, int] | None]:
        view = queue_view(driver.state, running_since, since + at_s * NS_PER_S, times)
        ((running,), (entry,)) = view.running, view.waiting
        assert running.expected_end_at is not None and entry.estimated_start_at is not None
        end, start = running.expected_end_at - since / NS_PER_S, entry.estimated_start_at
        return end, start - since / NS_PER_S, running.expected_end_open, running.progress

    assert ends(10) == (30.0, 30.0, False, None)
    progressed = ev.RequestProgressed(
        at=since + 20 * NS_PER_S, request_id="render", done=5, total=20
    )
    apply(driver.state, progressed)
    assert ends(21) == (80.0, 80.0, False, (5, 20))
    # Later and faster: 15 of 20 at 30 s, so 40 s in all.
    apply(
        driver.state,
        ev.RequestProgressed(at=since + 30 * NS_PER_S, request_id="render", done=15, total=20),
    )
    assert ends(31)[:3] == (40.0, 40.0, False)
    # Past what its progress said: measured against its model's runs again.
    assert ends(45)[2]
    # A progress of another request, or one with no total, changes nothing.
    apply(driver.state, ev.RequestProgressed(at=since, request_id="next", done=1, total=2))
    assert driver.state.requests["next"].progress is None


def test_a_run_of_a_model_with_no_history_has_an_open_end_once_past_its_default() -> None:
    # A first model, no run ever completed: its expected run is the default (0).
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    driver.enqueue("first", "m", 0)
    driver.step()
    running_since = {"first": driver.now}
    at = driver.now + 5 * NS_PER_S
    (running,) = queue_view(driver.state, running_since, at, Durations()).running
    assert running.expected_end_open  # not "+10 s at 5 s in"
    assert running.expected_end_at == at / NS_PER_S


def test_a_start_after_a_load_that_waits_for_an_open_run_is_the_earliest_it_can_be() -> None:
    # b needs B loaded, which evicts A once A's open-ended run has drained: the
    # 10 s load is known, what comes before it is not.
    driver = CoreDriver(ScoringParams(0, 0), resident="A")
    driver.enqueue("first", "A", 0)
    driver.step()
    running_since = {"first": driver.now}
    driver.enqueue("b", "B", 0)
    at = driver.now + 5 * NS_PER_S
    times = Durations(load_ns={"B": 10 * NS_PER_S})
    (entry,) = queue_view(driver.state, running_since, at, times).waiting
    assert (entry.estimated_start_in_s, entry.estimated_start_open) == (10.0, True)
    # Once A has a run of an hour in its history, the start is an estimate again.
    times = Durations(load_ns={"B": 10 * NS_PER_S}, runs_seen_ns={"A": (3600 * NS_PER_S,)})
    (entry,) = queue_view(driver.state, running_since, at, times).waiting
    assert (entry.estimated_start_in_s, entry.estimated_start_open) == (3605.0, False)


def test_the_logs_run_times_measure_an_overrun_as_the_live_server_does() -> None:
    # explain and bench.eta_bench read run times from the log: the runs an
    # overrun is measured against are the live server's (its last 32 per model).
    samples = [("m", float(s)) for s in range(1, 41)] + [("n", 7.0)]  # oldest first
    learnt = RunEstimates()
    for model, seconds in samples:
        learnt.observe(model, "", int(seconds * NS_PER_S))
    read = RunTimes(recent_run_s=recent_by_model(samples)).durations()
    assert read.runs_seen_ns == learnt.durations().runs_seen_ns
    assert read.longer_than("m", 38 * NS_PER_S) == (39 * NS_PER_S, 40 * NS_PER_S)
