"""The wait a refused caller is told (app/runtime/admission.py): the expected runs
of what would go before it, and recomputed at most once a second, so a client
hammering a full queue does not cost an O(n) pass per refusal."""

from __future__ import annotations

from app.core.scoring import NS_PER_S, ScoringParams
from app.runtime.admission import WaitEstimates, estimated_wait_s
from tests.unit.core_driver import CoreDriver

MIN = 60 * NS_PER_S


def test_the_estimate_counts_the_work_at_or_above_the_priority() -> None:
    driver = CoreDriver(ScoringParams(), resident="m")
    driver.enqueue("running", "m", 0, expected_run_ns=2 * MIN)
    driver.step()
    running_since = {"running": driver.now}
    driver.enqueue("batch", "m", -100, expected_run_ns=10 * MIN)
    driver.enqueue("normal", "m", 0, expected_run_ns=3 * MIN)
    driver.enqueue("unknown", "m", 0)  # no history: the median of those known (3 min)
    driver.advance(MIN)  # the running one has 1 min left
    state, now = driver.state, driver.now
    assert estimated_wait_s(state, 0, running_since, now) == (1 + 3 + 3) * 60
    assert estimated_wait_s(state, -100, running_since, now) == (1 + 3 + 3 + 10) * 60
    assert estimated_wait_s(state, 100, running_since, now) == 60


def test_estimates_are_kept_for_a_second_per_priority() -> None:
    driver = CoreDriver(ScoringParams(), resident="m")
    driver.enqueue("a", "m", 0, expected_run_ns=MIN)
    waits = WaitEstimates()
    first = waits.get(driver.state, 0, {}, driver.now)
    assert first == 60
    driver.enqueue("b", "m", 0, expected_run_ns=MIN)
    driver.advance(NS_PER_S // 2)
    assert waits.get(driver.state, 0, {}, driver.now) == 60  # within the second: kept
    assert waits.get(driver.state, -100, {}, driver.now) == 120  # another priority: fresh
    driver.advance(NS_PER_S // 2)
    assert waits.get(driver.state, 0, {}, driver.now) == 120  # a second later: recomputed
