"""The wait a refused caller is told (app/runtime/admission.py): the live queue's
own estimate (app/core/start_estimate.py) of when it would start: what is left of
the running work, divided among the slots, and the expected runs and loads of
what would go before it, in the queue's own order, lanes side by side; and
recomputed at most once a second, so a client hammering a full queue does not
cost an O(n) pass per refusal."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from app.config import parse_config
from app.core.run_estimate import Durations, RunEstimates
from app.core.scoring import NS_PER_S, ScoringParams
from app.runtime.admission import (
    BatchLines,
    Refused,
    Wait,
    WaitEstimates,
    check_bounds,
    estimated_wait_s,
)
from tests.unit.core_driver import CoreDriver

MIN = 60 * NS_PER_S


def wait(
    driver: CoreDriver,
    priority: int,
    model: str = "m",
    *,
    running_since: Mapping[str, int] | None = None,
    loads: Mapping[str, int] | None = None,
    runs: Mapping[str, int] | None = None,
) -> int:
    """The estimate for a request arriving now."""
    arriving = driver.state.newcomer(model, priority, driver.now)
    times = Durations(dict(runs or {}), dict(loads or {}))
    return estimated_wait_s(driver.state, arriving, running_since or {}, driver.now, times)


def test_the_estimate_counts_the_work_that_would_go_before() -> None:
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    driver.enqueue("running", "m", 0, expected_run_ns=2 * MIN)
    driver.step()
    running_since = {"running": driver.now}
    driver.enqueue("batch", "m", -100, expected_run_ns=10 * MIN)
    driver.enqueue("normal", "m", 0, expected_run_ns=3 * MIN)
    driver.enqueue("unknown", "m", 0)  # no history of its own: its model's (3 min)
    driver.advance(MIN)  # the running one has 1 min left
    runs = {"m": 3 * MIN}
    assert wait(driver, 0, running_since=running_since, runs=runs) == (1 + 3 + 3) * 60
    assert wait(driver, -100, running_since=running_since, runs=runs) == (1 + 3 + 3 + 10) * 60
    assert wait(driver, 100, running_since=running_since, runs=runs) == 60


def test_requests_lifted_by_aging_count_as_ahead() -> None:
    # A job of priority 0 that has waited 10 minutes (aging 1 point a minute) now
    # scores 10: it goes before a newcomer at 5, which once was told 1 s.
    driver = CoreDriver(ScoringParams(MIN, 0), resident="m")
    driver.enqueue("old", "m", 0, expected_run_ns=MIN)
    driver.advance(10 * MIN)
    assert wait(driver, 5) == 60
    assert wait(driver, 20) == 1  # at 20 it goes first: nothing to wait for


def test_a_run_past_its_expected_time_ends_with_its_models_longer_runs() -> None:
    learnt = RunEstimates()
    for minutes in (1, 2, 4, 8):
        learnt.observe("m", "", minutes * MIN)
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    driver.enqueue("slow", "m", 0, expected_run_ns=2 * MIN)
    driver.step()
    running_since = {"slow": driver.now}
    driver.advance(3 * MIN)
    waits = WaitEstimates(learnt.durations)
    arriving = driver.state.newcomer("m", 0, driver.now)
    # Having run 3 min (1 past its 2): its model's runs longer than that took 4
    # and 8 min; their (lower) median says 1 min more.
    told = waits.wait(driver.state, arriving, running_since, driver.now)
    assert told == Wait(60)
    assert told.text() == "about 60 s"


def test_behind_a_run_longer_than_any_of_its_model_the_wait_is_the_known_one_said_so() -> None:
    # Issue 39: a Retry-After of 17 s where the wait was over 50 s. The running
    # job has outrun every run of its model: nobody knows when it ends. The
    # wait told is the work known to be left (a's 1 min), and says so.
    learnt = RunEstimates()
    learnt.observe("m", "", 2 * MIN)
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    driver.enqueue("slow", "m", 0)
    driver.step()
    running_since = {"slow": driver.now}
    driver.enqueue("a", "m", 0, expected_run_ns=MIN)
    driver.advance(5 * MIN)
    config = parse_config("maxQueued: 1\nmodels:\n  m:\n    cmd: server --port ${PORT}\n")
    arriving = driver.state.newcomer("m", 0, driver.now)
    waits = WaitEstimates(learnt.durations)
    with pytest.raises(Refused) as refused:
        check_bounds(config, driver.state, arriving, running_since, driver.now, waits)
    assert refused.value.retry_after == 60
    assert str(refused.value) == (
        "the queue is full: 1 requests are waiting (maxQueued 1); retry after at least 60 s "
        "(the work known to be left: work ahead has run longer than any run of its model, "
        "its end unknown)"
    )
    # A minute later it still runs: still the known minute, still said as such.
    driver.advance(MIN)
    later = WaitEstimates(learnt.durations)
    assert later.wait(driver.state, arriving, running_since, driver.now) == Wait(60, open=True)


def test_loads_of_other_models_count() -> None:
    # B is not loaded: the queued B request needs a 30 s load before its 1 min run.
    driver = CoreDriver(ScoringParams(0, 0), resident="A")
    driver.enqueue("b", "B", 0, expected_run_ns=MIN)
    loads = {"B": 30 * NS_PER_S, "C": 20 * NS_PER_S}
    assert wait(driver, 0, "B", loads=loads) == 30 + 60
    # A newcomer for C waits for B's load and run, then its own load.
    assert wait(driver, 0, "C", loads=loads) == 30 + 60 + 20
    # A request dispatched into a load still has the load's rest ahead of it.
    assert driver.state.loading is None and driver.step() is not None
    assert driver.state.loading == "B"  # dispatched into B's load
    running_since = {"b": driver.now}
    driver.advance(10 * NS_PER_S)
    assert wait(driver, 0, "B", running_since=running_since, loads=loads) == 20 + 60


def test_with_no_history_of_their_own_requests_take_their_models_run_time() -> None:
    driver = CoreDriver(ScoringParams(0, 0), resident="m")
    for rid in ("a", "b", "c"):
        driver.enqueue(rid, "m", 0)  # enqueued before any run had finished
    arriving = driver.state.newcomer("m", 0, driver.now, expected_run_ns=2 * NS_PER_S)
    times = Durations({"m": 2 * NS_PER_S})
    assert estimated_wait_s(driver.state, arriving, {}, driver.now, times) == 3 * 2


def test_running_work_is_divided_among_the_slots() -> None:
    # Three slots, all busy (ending in 1, 2 and 3 min), four more waiting of 1 min:
    # they take the slots as they free; a newcomer takes the fifth free slot.
    driver = CoreDriver(ScoringParams(0, 0), resident="m", concurrency={"m": 3})
    for i in range(3):
        driver.enqueue(f"run{i}", "m", 0, expected_run_ns=(i + 1) * MIN)
        driver.step()
    assert len(driver.state.running) == 3
    running_since = dict.fromkeys(driver.state.running, driver.now)
    for i in range(4):
        driver.enqueue(f"w{i}", "m", 0, expected_run_ns=MIN)
    # Slots free at 1, 2, 3; w0 at 1 (frees 2), w1 at 2 (3), w2 at 2 (3), w3 at 3.
    assert wait(driver, 0, running_since=running_since) == 3 * 60
    # One slot, the same work: 6 min of running work, then four 1 min runs.
    one = CoreDriver(ScoringParams(0, 0), resident="m")
    one.enqueue("run", "m", 0, expected_run_ns=6 * MIN)
    one.step()
    for i in range(4):
        one.enqueue(f"w{i}", "m", 0, expected_run_ns=MIN)
    assert wait(one, 0, running_since={"run": one.now}) == 10 * 60


def test_estimates_are_kept_for_a_second_per_priority_and_model() -> None:
    driver = CoreDriver(ScoringParams(), resident="m")
    driver.enqueue("a", "m", 0, expected_run_ns=MIN)
    waits = WaitEstimates()

    def get(priority: int, model: str = "m") -> int:
        arriving = driver.state.newcomer(model, priority, driver.now)
        return waits.get(driver.state, arriving, {}, driver.now)

    assert get(0) == 60
    driver.enqueue("b", "m", 0, expected_run_ns=MIN)
    driver.advance(NS_PER_S // 2)
    assert get(0) == 60  # within the second: kept
    assert get(-100) == 120  # another priority: fresh
    assert get(0, "other") == 120  # another model: fresh
    driver.advance(NS_PER_S // 2)
    assert get(0) == 120  # a second later: recomputed


def test_a_callers_waiting_batch_lines_are_counted_apart_and_ended_ones_dropped() -> None:
    driver = CoreDriver(ScoringParams(), resident="m")
    lines = BatchLines()
    for rid in ("l1", "l2", "l3"):
        driver.enqueue(rid, "m", -100, durable=True, caller="alice")
        lines.add("alice", rid)
    driver.enqueue("single", "m", 0, caller="alice")
    assert lines.waiting("alice", driver.state) == 3
    assert lines.waiting("bob", driver.state) == 0
    assert driver.step() is not None  # "single" runs: not a line
    assert lines.waiting("alice", driver.state) == 3
    driver.complete("single")
    assert driver.step() is not None  # l1 runs: no longer waiting
    assert lines.waiting("alice", driver.state) == 2
    driver.complete("l1")
    driver.cancel("l2")
    assert lines.waiting("alice", driver.state) == 1
    driver.cancel("l3")
    assert lines.waiting("alice", driver.state) == 0


def test_the_learnt_times_are_each_models_median_run_and_load() -> None:
    learnt = RunEstimates()
    assert learnt.durations() == Durations()
    for endpoint, seconds in (("/v1/chat/completions", 4), ("/v1/embeddings", 1), ("", 9)):
        learnt.observe("m", endpoint, seconds * NS_PER_S)
    learnt.observe("n", "", 20 * NS_PER_S)
    for seconds in (30, 10, 20):
        learnt.observe_load("m", seconds * NS_PER_S)
    times = learnt.durations()
    assert times.run("m") == 4 * NS_PER_S  # the median over its endpoints
    assert times.load("m") == 20 * NS_PER_S
    assert times.run("never") == 4 * NS_PER_S  # the lower median of the models' medians
    assert times.load("n") == 20 * NS_PER_S
    # A request's own learnt run (per endpoint, recorded at enqueue) comes first.
    assert times.of("m", 1 * NS_PER_S) == NS_PER_S and times.of("m", None) == 4 * NS_PER_S
    waits = WaitEstimates(learnt.durations)
    driver = CoreDriver(ScoringParams(0, 0), resident="n")
    driver.enqueue("a", "m", 0)
    arriving = driver.state.newcomer("m", 0, driver.now)
    assert waits.get(driver.state, arriving, {}, driver.now) == 20 + 4  # load, then a's run
