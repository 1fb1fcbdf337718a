"""Serial with slots (issue 23, item 2): a resident model runs up to its
`concurrencyLimit` requests at once, they take free slots in score order, and a
higher-scored request for another model drains the lane (docs/scheduling.md,
Slots and the dispatch rule). With one slot per model, today's decisions exactly."""

from __future__ import annotations

import random

import msgspec
import pytest

from app.core import events as ev
from app.core.policy import decide
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from tests.unit.core_driver import CoreDriver
from tools.replay.verify import verify

S = NS_PER_S
PARAMS = ScoringParams(aging_divisor_ns=60 * S, swap_affinity_bonus=10)
INTERACTIVE, BATCH = 100, -100


def slots(concurrency: dict[str, int], resident: str | None = "A") -> CoreDriver:
    return CoreDriver(PARAMS, resident=resident, concurrency=concurrency)


def verifies(d: CoreDriver) -> bool:
    result = verify(enumerate(d.log, start=1))
    assert result.decisions == len(d.dispatches)
    return result.ok


def test_three_batch_and_one_interactive_on_a_four_slot_model_all_start_at_once() -> None:
    d = slots({"A": 4})
    for rid, priority in [("b0", BATCH), ("b1", BATCH), ("b2", BATCH), ("i", INTERACTIVE)]:
        d.enqueue(rid, "A", priority)
        d.advance(S)
    # in score order: the interactive one first, then the batch ones by arrival
    assert d.dispatch_all() == ["i", "b0", "b1", "b2"]
    assert not any(x.swap for x in d.dispatches)
    assert d.state.running_on("A") == 4
    assert verifies(d)


def test_a_full_model_takes_the_next_request_when_a_slot_frees() -> None:
    d = slots({"A": 2})
    for i in range(4):
        d.enqueue(f"a{i}", "A")
    assert d.dispatch_all() == ["a0", "a1"]
    d.enqueue("hi", "A", INTERACTIVE)
    assert d.dispatch_all() == []  # both slots busy
    d.complete("a1")
    assert d.dispatch_all() == ["hi"]  # the free slot goes to the best score
    d.complete("a0")
    assert d.dispatch_all() == ["a2"]
    assert verifies(d)


def test_from_cold_the_first_request_loads_the_model_and_the_next_ones_join_that_load() -> None:
    d = slots({"A": 3}, resident=None)
    for i in range(4):
        d.enqueue(f"a{i}", "A")
    first = decide(d.state, d.now)
    assert first is not None and first.action == "swap"
    for event in first.events:
        d.apply(event)
    join = decide(d.state, d.now)
    assert join is not None and (join.action, join.dispatched.swap) == ("join", False)
    assert join.dispatched.request_id == "a1"
    for event in join.events:
        d.apply(event)
    d.start_swap("A", "a0")
    assert d.dispatch_all() == ["a2"]  # joins too; a3 waits for a free slot
    d.finish_swap("A")
    assert d.dispatch_all() == []
    d.complete("a0")
    assert d.dispatch_all() == ["a3"]


def test_a_load_no_request_waits_on_is_not_joined() -> None:
    # A preload (or a load whose request left): requests wait for it to end, then
    # take the slots in score order, as a one-slot lane did.
    d = slots({"A": 3}, resident=None)
    d.start_swap("A")
    d.enqueue("a0", "A")
    d.enqueue("a1", "A", INTERACTIVE)
    assert d.dispatch_all() == []
    d.finish_swap("A")
    assert d.dispatch_all() == ["a1", "a0"]


def test_a_higher_request_for_another_model_drains_the_lane_then_swaps() -> None:
    d = slots({"A": 3, "B": 2})
    d.enqueue("a0", "A", BATCH)
    assert d.dispatch_all() == ["a0"]
    d.advance(S)
    d.enqueue("b0", "B", 0)  # wants B: A must be evicted
    d.enqueue("a1", "A", BATCH)  # A has two free slots, but b0 scores higher
    d.enqueue("b1", "B", BATCH)
    assert d.dispatch_all() == []
    d.advance(10 * S)
    d.complete("a0")  # the lane drained: the swap happens now
    assert d.dispatch_all() == ["b0", "b1"]
    assert [x.swap for x in d.dispatches[-2:]] == [True, False]  # b1 joins b0's load
    d.start_swap("B", "b0")
    d.finish_swap("B")
    d.complete("b0")
    d.complete("b1")
    assert d.dispatch_all() == ["a1"]
    assert d.dispatches[-1].swap is True
    assert verifies(d)


def test_during_a_drain_a_better_request_for_the_model_in_use_still_takes_a_free_slot() -> None:
    d = slots({"A": 3})
    d.enqueue("a0", "A")
    assert d.dispatch_all() == ["a0"]
    d.enqueue("b0", "B")
    d.enqueue("a1", "A", BATCH)
    assert d.dispatch_all() == []  # a1 may not pass b0
    d.enqueue("a2", "A", INTERACTIVE)  # outranks b0: it may start
    assert d.dispatch_all() == ["a2"]
    d.complete("a0")
    assert d.dispatch_all() == []  # a2 still runs on A
    d.complete("a2")
    assert d.dispatch_all() == ["b0"]
    assert verifies(d)


def test_a_lower_request_for_another_model_does_not_hold_the_free_slots() -> None:
    d = slots({"A": 3})
    d.enqueue("a0", "A")
    assert d.dispatch_all() == ["a0"]
    d.enqueue("b0", "B", BATCH)
    d.enqueue("a1", "A")
    d.enqueue("a2", "A")
    assert d.dispatch_all() == ["a1", "a2"]
    d.complete("a0")
    d.complete("a1")
    assert d.dispatch_all() == []  # a2 runs: b0 waits for the drain
    d.complete("a2")
    assert d.dispatch_all() == ["b0"]


def test_swap_affinity_applies_to_the_model_in_use_when_it_has_a_free_slot() -> None:
    d = slots({"A": 2})
    d.enqueue("a0", "A")
    assert d.dispatch_all() == ["a0"]
    d.enqueue("b0", "B")
    d.advance(S)
    d.enqueue("a1", "A")  # one second younger than b0, but +10 for A
    assert d.dispatch_all() == ["a1"]
    assert d.scores[-1].winner.affinity == 10
    assert d.scores[-1].without_affinity_id == "b0"


@pytest.mark.parametrize("log_format", [1, 2, 3])
def test_serial_logs_before_format_4_ran_one_at_a_time_whatever_they_recorded(
    log_format: int,
) -> None:
    # Older servers recorded fifo's default 10 for every model under serial too.
    d = CoreDriver(PARAMS)
    d.start_server(PARAMS, concurrency={"A": 10}, log_format=log_format)
    d.load("A")
    for i in range(3):
        d.enqueue(f"a{i}", "A")
    assert d.dispatch_all() == ["a0"]
    assert d.state.slots("A") == 1
    d.complete("a0")
    assert d.dispatch_all() == ["a1"]
    assert verifies(d)


def test_the_default_under_serial_is_one_slot_and_under_fifo_ten() -> None:
    assert SchedulerState(scheduler="serial").slots("m") == 1
    assert SchedulerState(scheduler="fifo").slots("m") == 10
    assert SchedulerState(scheduler="serial", concurrency={"m": 4}).slots("m") == 4


MODELS = ("A", "B", "C")


def random_run(seed: int, concurrency: dict[str, int], log_format: int) -> CoreDriver:
    """A random trace: arrivals, swaps that take time, runs that end in random
    order, and decisions after every change."""
    rng = random.Random(seed)
    d = CoreDriver(PARAMS)
    d.start_server(PARAMS, concurrency=concurrency, log_format=log_format)
    loading: str | None = None
    for i in range(300):
        d.advance(rng.choice([0, S // 10, S, 5 * S, 90 * S]))
        roll = rng.random()
        if roll < 0.5:
            d.enqueue(f"r{i}", rng.choice(MODELS), rng.choice([BATCH, 0, 0, INTERACTIVE, 3]))
        elif loading is not None:
            d.finish_swap(loading)
            loading = None
        elif d.state.running and roll < 0.9:
            d.complete(rng.choice(sorted(d.state.running)))
        elif d.state.queue:
            d.cancel(rng.choice(sorted(q.request_id for q in d.state.queue)))
        while (x := d.step()) is not None:
            if x.swap:
                d.start_swap(x.model, x.request_id)
                loading = x.model
    return d


@pytest.mark.parametrize("seed", range(6))
def test_with_one_slot_per_model_the_decisions_are_todays(seed: int) -> None:
    today = random_run(seed, {m: 10 for m in MODELS}, log_format=3)
    one = random_run(seed, {m: 1 for m in MODELS}, log_format=ev.LOG_FORMAT)
    unset = random_run(seed, {}, log_format=ev.LOG_FORMAT)
    assert len(today.dispatches) > 50
    assert one.dispatches == today.dispatches == unset.dispatches
    assert [msgspec.structs.asdict(s) for s in one.scores] == [
        msgspec.structs.asdict(s) for s in today.scores
    ]


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_with_slots_stay_within_them_and_verify(seed: int) -> None:
    d = random_run(seed, {"A": 3, "B": 2}, log_format=ev.LOG_FORMAT)
    assert verifies(d)
    # replaying the log, the running requests never exceed the slots of one model
    state = SchedulerState()
    most = 0
    for event in d.log:
        apply(state, event)
        models = set(state.running.values())
        assert len(models) <= 1
        for m in models:
            assert state.running_on(m) <= state.slots(m)
            most = max(most, state.running_on(m))
    assert most > 1
