"""The scheduling policy end to end through `apply` and `decide` (DESIGN.md scenarios)."""

from __future__ import annotations

import random

import pytest

from app.core import events as ev
from app.core.load_backoff import NO_BACKOFF, LoadBackoff
from app.core.policy import decide, given_up, reorder_reasons
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import FIFO
from tests.unit.core_driver import CoreDriver
from tools.replay.verify import verify

S = NS_PER_S
MIN = 60 * S


def params(divisor_ns: int = MIN, bonus: int = 10) -> ScoringParams:
    return ScoringParams(aging_divisor_ns=divisor_ns, swap_affinity_bonus=bonus)


def a_b_c_a_behind_a_long_job(bonus: int) -> CoreDriver:
    """A resident; a long job on A holds the GPU while A, B, C, A arrive 1 s apart."""
    d = CoreDriver(params(MIN, bonus), resident="A")
    d.enqueue("long", "A")
    assert d.dispatch_all() == ["long"]
    for rid, model in [("A1", "A"), ("B1", "B"), ("C1", "C"), ("A2", "A")]:
        d.advance(1 * S)
        d.enqueue(rid, model)
        assert d.step() is None  # the GPU is busy
    d.advance(10 * MIN)  # the long job runs; everyone ages alike
    d.complete("long")
    return d


# -- the examples in DESIGN.md -----------------------------------------------


def test_a_b_c_a_with_a_resident_serves_a_a_b_c_at_bonus_10() -> None:
    d = a_b_c_a_behind_a_long_job(bonus=10)
    assert d.serve_all() == ["A1", "A2", "B1", "C1"]
    assert [x.swap for x in d.dispatches[1:]] == [False, False, True, True]
    # A2 jumped B1 and C1 because of the bonus alone
    assert reorder_reasons(d.scores[2]) == ["swap_affinity"]
    assert d.scores[2].without_affinity_id == "B1"


def test_a_b_c_a_with_a_resident_serves_a_b_c_a_at_bonus_0() -> None:
    d = a_b_c_a_behind_a_long_job(bonus=0)
    assert d.serve_all() == ["A1", "B1", "C1", "A2"]
    assert [x.swap for x in d.dispatches[1:]] == [False, True, True, True]
    assert all(reorder_reasons(s) == [] for s in d.scores)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_priorities_at_bonus_0_are_exact_fifo_over_many_requests_and_models(
    seed: int,
) -> None:
    rng = random.Random(seed)
    d = CoreDriver(params(MIN, 0), resident="m0")
    d.enqueue("hold", "m0")
    assert d.dispatch_all() == ["hold"]
    arrivals = []
    for i in range(400):
        d.advance(rng.choice([0, 0, 1, 1_000, S, 7 * MIN]))  # ties in time included
        rid = f"r{i}"
        d.enqueue(rid, f"m{rng.randrange(9)}", priority=5)
        arrivals.append(rid)
    d.complete("hold")
    assert d.serve_all() == arrivals


def test_tier_offsets_order_inside_a_band_and_every_batch_tier_after_normal() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("long", "A")
    d.dispatch_all()
    for rid, prio in [("b100", -100), ("b99", -99), ("b98", -98), ("n0", 0)]:
        d.enqueue(rid, "A", prio)  # worst first: aging favours the earliest by < 1 point
        d.advance(10 * S)
    d.complete("long")
    assert d.serve_all() == ["n0", "b98", "b99", "b100"]


def test_interactive_tiers_order_max_pro_free() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("long", "A")
    d.dispatch_all()
    for rid, prio in [("free", 100), ("pro", 101), ("max", 102)]:
        d.enqueue(rid, "A", prio)
        d.advance(30 * S)
    d.complete("long")
    assert d.serve_all() == ["max", "pro", "free"]


# -- aging boundaries ------------------------------------------------------------

DIVISORS = [MIN, S // 2, 7]  # 60 s (default), 0.5 s, 7 ns


@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize(
    ("offset_ns", "first"),
    [(-1, "interactive"), (0, "batch"), (1, "batch")],
    ids=["1ns_before_198D_interactive_first", "at_198D_tie_arrival_order", "1ns_after_batch"],
)
def test_max_tier_batch_overtakes_fresh_free_interactive_after_198_divisors(
    divisor: int, offset_ns: int, first: str
) -> None:
    # Both requests are for A, the resident model, so affinity cannot differ:
    # -98 + waited/D against +100 + 0 crosses at waited = 198 D exactly.
    d = CoreDriver(params(divisor, 10), resident="A")
    d.enqueue("long", "A")
    d.dispatch_all()
    d.enqueue("batch", "A", -98)
    d.advance(198 * divisor + offset_ns)
    d.enqueue("interactive", "A", 100)
    d.complete("long")
    # decided the moment the interactive request arrives (fresh) ...
    decision = decide(d.state, d.now)
    assert decision is not None and decision.dispatched.request_id == first
    # ... and the order does not depend on when the decision is made
    d.advance(1000 * divisor)
    assert d.serve_all() == [first, "interactive" if first == "batch" else "batch"]
    scores = d.scores[1]
    assert not any(x.swap for x in d.dispatches)
    assert reorder_reasons(scores) == (["aging"] if first == "batch" else [])


@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("bonus", [0, 10, 99])
@pytest.mark.parametrize(("offset_ns", "first"), [(-1, "fresh"), (0, "old"), (1, "old")])
def test_a_minus_100_request_overtakes_a_fresh_plus_100_resident_one_after_200_plus_bonus_divisors(
    divisor: int, bonus: int, offset_ns: int, first: str
) -> None:
    # The starvation bound: "old" (-100, model B, needs a swap) against "fresh"
    # (+100, model A, resident, needs none), behind one running job.
    d = CoreDriver(params(divisor, bonus), resident="A")
    d.enqueue("running", "A")
    d.dispatch_all()
    d.enqueue("old", "B", -100)
    d.advance((200 + bonus) * divisor + offset_ns)
    d.enqueue("fresh", "A", 100)
    d.complete("running")
    order = d.serve_all()
    assert order[0] == first
    assert d.dispatches[1].swap == (first == "old")


def test_aging_divisor_0_disables_aging_an_old_batch_request_never_overtakes() -> None:
    d = CoreDriver(params(0, 10), resident="A")
    d.enqueue("running", "A")
    d.dispatch_all()
    d.enqueue("old_batch", "A", -100)
    d.advance(10**6 * S)  # eleven days
    d.enqueue("fresh_normal", "B", 0)  # even without the resident bonus
    d.advance(10**6 * S)
    d.complete("running")
    assert d.serve_all() == ["fresh_normal", "old_batch"]
    assert d.scores[1].winner.aging == 0.0
    assert reorder_reasons(d.scores[1]) == []


# -- serial mechanics ---------------------------------------------------------------


def test_serial_never_dispatches_while_a_request_runs() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("r1", "A", 100)
    d.enqueue("r2", "A", 100)
    assert d.dispatch_all() == ["r1"]  # one at a time even for the resident model
    d.enqueue("r3", "B", 10**6)
    for _ in range(3):
        d.advance(10 * MIN)
        assert decide(d.state, d.now) is None
    d.complete("r1")
    assert d.dispatch_all() == ["r3"]


def test_serial_never_dispatches_while_a_swap_loads() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("r1", "A")
    d.start_swap("B")  # a preload: nothing runs, but B is loading
    assert d.state.running == {} and d.state.loading == "B"
    assert decide(d.state, d.now) is None
    d.finish_swap("B")
    assert d.dispatch_all() == ["r1"]
    assert d.dispatches[0].swap is True  # A is no longer resident


def test_serial_waits_for_the_swap_its_own_dispatch_started() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("b1", "B")
    d.enqueue("b2", "B")
    assert d.dispatch_all() == ["b1"]
    d.start_swap("B", "b1")
    d.complete("b1")  # even if the request is over, the swap is still loading
    assert decide(d.state, d.now) is None
    d.finish_swap("B")
    assert d.dispatch_all() == ["b2"]
    assert d.dispatches[1].swap is False


@pytest.mark.parametrize(
    ("resident", "model", "swap"),
    [("A", "A", False), ("A", "B", True), (None, "A", True)],
    ids=["resident_model_no_swap", "other_model_swaps", "nothing_resident_swaps"],
)
def test_dispatch_marks_swap_exactly_when_the_model_is_not_resident(
    resident: str | None, model: str, swap: bool
) -> None:
    d = CoreDriver(params(), resident=resident)
    d.enqueue("r", model)
    assert d.dispatch_all() == ["r"]
    assert d.dispatches[0].swap is swap
    assert d.dispatches[0].model == model
    assert d.scores[0].resident == resident


def test_decide_is_pure_and_reports_the_scores_it_used() -> None:
    d = CoreDriver(params(MIN, 10), resident="A")
    d.enqueue("b", "B", 0)
    d.advance(2 * MIN)
    d.enqueue("a", "A", 0)
    d.advance(1 * MIN)
    first = decide(d.state, d.now)
    assert decide(d.state, d.now) == first  # nothing applied, nothing changed
    assert first is not None and first.action == "run"  # A is resident
    scores, dispatched = first.scores, first.dispatched
    assert scores.request_id == dispatched.request_id == "a"  # 10 + 1 beats 0 + 3
    assert scores.queue_depth == 2
    assert scores.winner == ev.Breakdown(priority=0, affinity=10, aging=1.0, total=11.0)
    assert scores.runner_up_id == "b"
    assert scores.runner_up == ev.Breakdown(priority=0, affinity=0, aging=3.0, total=3.0)
    assert (scores.without_aging_id, scores.without_affinity_id) == ("a", "b")
    assert (scores.aging_divisor_ns, scores.swap_affinity_bonus) == (MIN, 10)
    assert scores.scheduler == "serial"
    assert reorder_reasons(scores) == ["swap_affinity"]


def test_a_cancelled_request_is_never_dispatched() -> None:
    d = CoreDriver(params(), resident="A")
    d.enqueue("r1", "A", 100)
    d.enqueue("r2", "A", 0)
    d.cancel("r1")
    assert d.serve_all() == ["r2"]


# -- fifo -----------------------------------------------------------------------------


def fifo(**kw: object) -> CoreDriver:
    return CoreDriver(params(), scheduler=FIFO, **kw)  # type: ignore[arg-type]


def test_fifo_a_model_at_10_with_a_batch_header_queues_at_minus_90_behind_normal() -> None:
    # X is at 10: with a batch header it queues at -90, behind Y (0) with normal,
    # even though it arrived first.
    d = fifo(model_priority={"X": 10, "Y": 0})
    d.enqueue("x_batch", "X", -100)
    d.advance(MIN)
    d.enqueue("y_normal", "Y", 0)
    assert d.serve_all() == ["y_normal", "x_batch"]
    assert [s.winner.priority for s in d.scores] == [0, -90]
    assert [s.winner.aging for s in d.scores] == [0.0, 0.0]  # fifo does not age
    assert all(s.scheduler == "fifo" for s in d.scores)
    assert all(reorder_reasons(s) == [] for s in d.scores)


def test_fifo_a_model_at_10_with_a_normal_header_queues_ahead_of_a_model_at_0() -> None:
    d = fifo(model_priority={"X": 10, "Y": 0})
    d.enqueue("y_normal", "Y", 0)
    d.advance(MIN)
    d.enqueue("x_batch", "X", -100)
    d.enqueue("x_normal", "X", 0)
    assert d.serve_all() == ["x_normal", "y_normal", "x_batch"]
    assert [s.winner.priority for s in d.scores] == [10, 0, -90]
    assert [x.swap for x in d.dispatches] == [True, True, True]


def test_fifo_dispatches_made_in_one_moment_see_the_swap_the_first_one_committed_to() -> None:
    # decide is called again right after a swap dispatch, before SwapStarted is
    # recorded: the next request for the incoming model joins that load, and a
    # request for the outgoing model must not be sent to it.
    d = fifo(resident="A", concurrency={"B": 2})
    d.enqueue("b0", "B")
    d.enqueue("b1", "B")
    d.enqueue("a0", "A")
    assert d.dispatch_all() == ["b0", "b1"]
    assert [x.swap for x in d.dispatches] == [True, False]
    assert d.state.loading == "B"


def test_fifo_dispatches_requests_for_the_ready_model_up_to_its_concurrency_limit() -> None:
    d = fifo(resident="A", concurrency={"A": 2})
    for i in range(4):
        d.enqueue(f"a{i}", "A")
    assert d.dispatch_all() == ["a0", "a1"]
    assert not any(x.swap for x in d.dispatches)
    d.complete("a0")
    assert d.dispatch_all() == ["a2"]
    d.complete("a1")
    d.complete("a2")
    assert d.dispatch_all() == ["a3"]


def test_fifo_head_for_another_model_waits_until_nothing_is_in_flight_then_swaps() -> None:
    d = fifo(resident="A", concurrency={"A": 4})
    d.enqueue("a0", "A")
    d.enqueue("a1", "A")
    assert d.dispatch_all() == ["a0", "a1"]
    d.enqueue("b0", "B")
    d.enqueue("a2", "A")  # behind the head: does not jump it
    assert d.dispatch_all() == []
    d.complete("a0")
    assert d.dispatch_all() == []
    d.complete("a1")
    assert d.dispatch_all() == ["b0"]
    assert d.dispatches[-1].swap is True


def test_fifo_requests_for_the_loading_model_join_that_load() -> None:
    d = fifo(resident="A", concurrency={"B": 3})
    d.enqueue("b0", "B")
    assert d.dispatch_all() == ["b0"]
    assert d.dispatches[-1].swap is True
    d.start_swap("B", "b0")
    assert d.state.loading == "B" and d.state.resident is None
    for i in (1, 2, 3):
        d.enqueue(f"b{i}", "B")
    d.enqueue("a9", "A")
    # b1 and b2 join the load (no second swap) up to B's limit of 3; b3 waits
    assert d.dispatch_all() == ["b1", "b2"]
    assert [x.swap for x in d.dispatches[1:]] == [False, False]
    d.finish_swap("B")
    d.complete("b0")
    assert d.dispatch_all() == ["b3"]
    for rid in ("b1", "b2", "b3"):
        d.complete(rid)
    assert d.dispatch_all() == ["a9"]
    assert d.dispatches[-1].swap is True


# -- reorder reasons -----------------------------------------------------------------


def _scores(
    winner: str, without_aging: str | None, without_affinity: str | None
) -> ev.ScoresComputed:
    b = ev.Breakdown(priority=0, affinity=0, aging=0.0, total=0.0)
    return ev.ScoresComputed(
        at=0,
        request_id=winner,
        queue_depth=1,
        resident=None,
        winner=b,
        without_aging_id=without_aging,
        without_affinity_id=without_affinity,
    )


@pytest.mark.parametrize(
    ("without_aging", "without_affinity", "reasons"),
    [
        ("w", "w", []),
        (None, None, []),
        ("x", "w", ["aging"]),
        ("w", "y", ["swap_affinity"]),
        ("x", "y", ["aging", "swap_affinity"]),
        ("x", None, ["aging"]),
    ],
)
def test_reorder_reasons_name_each_term_that_changed_the_winner(
    without_aging: str | None, without_affinity: str | None, reasons: list[str]
) -> None:
    assert reorder_reasons(_scores("w", without_aging, without_affinity)) == reasons


def test_a_decision_says_what_it_means_swap_join_or_run() -> None:
    d = CoreDriver(params(), scheduler="fifo", resident="A")
    d.enqueue("a1", "A")
    first = decide(d.state, d.now)
    assert first is not None and first.action == "run"
    d.serve_all()
    d.enqueue("b1", "B")
    d.enqueue("b2", "B")
    swap = decide(d.state, d.now)
    assert swap is not None and (swap.action, swap.dispatched.request_id) == ("swap", "b1")
    for event in swap.events:
        d.apply(event)
    join = decide(d.state, d.now)  # B is loading: b2 joins that load
    assert join is not None and (join.action, join.dispatched.request_id) == ("join", "b2")
    assert join.dispatched.swap is False


# -- back-off after failed loads -------------------------------------------------------


BACKOFF = LoadBackoff(first_ns=5 * S, max_ns=20 * S, failure_limit=3)


def test_the_backoff_doubles_from_its_first_wait_and_stops_at_its_most() -> None:
    assert [BACKOFF.delay_ns(n) // S for n in range(6)] == [0, 5, 10, 20, 20, 20]
    uneven = LoadBackoff(first_ns=5 * S, max_ns=12 * S)
    assert [uneven.delay_ns(n) // S for n in (1, 2, 3, 60)] == [5, 10, 12, 12]
    assert NO_BACKOFF.delay_ns(3) == 0


def a_failed_load_of_a(backoff: LoadBackoff = BACKOFF) -> CoreDriver:
    """A1 loads A and fails; A2 and A3 (interactive) and B1 (normal) wait."""
    d = CoreDriver(params(), load_backoff=backoff)
    for rid, model, priority in [("A1", "A", 100), ("A2", "A", 100), ("A3", "A", 100)]:
        d.enqueue(rid, model, priority)
    d.enqueue("B1", "B")
    assert d.step() is not None and d.dispatches[-1].request_id == "A1"
    d.start_swap("A", "A1")
    d.fail_swap("A")
    return d


def test_a_model_backs_off_after_a_failed_load_and_the_others_are_served_meanwhile() -> None:
    d = a_failed_load_of_a()
    assert d.state.load_failures["A"].count == 1
    assert d.state.backoff_until("A") == d.now + 5 * S
    assert d.serve_all() == ["B1"]  # A2 outranks B1, but A backs off
    d.advance(5 * S - 1)
    assert d.step() is None
    d.advance(1)
    assert d.step() is not None and d.dispatches[-1].request_id == "A2"
    assert d.dispatches[-1].swap
    d.start_swap("A", "A2")
    d.finish_swap("A")  # a load that works ends the series
    assert "A" not in d.state.load_failures and d.state.backoff_until("A") is None
    d.complete("A2")
    assert d.serve_all() == ["A3"]
    assert verify(enumerate(d.log, start=1)).ok


def test_the_waits_grow_and_after_the_limit_the_waiting_requests_are_given_up() -> None:
    d = a_failed_load_of_a()
    assert given_up(d.state, "A") == []
    d.advance(5 * S)
    assert d.step() is not None and d.dispatches[-1].request_id == "A2"
    d.start_swap("A", "A2")
    d.fail_swap("A")
    assert given_up(d.state, "A") == []
    d.advance(10 * S - 1)
    assert d.step() is not None and d.dispatches[-1].request_id == "B1"
    d.load("B")
    d.complete("B1")
    d.advance(1)
    assert d.step() is not None and d.dispatches[-1].request_id == "A3"
    d.enqueue("A4", "A")
    d.start_swap("A", "A3")
    d.fail_swap("A")
    assert d.state.load_failures["A"].count == 3
    assert given_up(d.state, "A") == ["A4"]
    assert verify(enumerate(d.log, start=1)).ok


def test_a_log_without_backoff_settings_loads_again_at_once() -> None:
    d = a_failed_load_of_a(NO_BACKOFF)  # server_started as every older log has it
    assert d.state.backing_off(d.now) == frozenset()
    assert d.step() is not None and d.dispatches[-1].request_id == "A2"
    assert given_up(d.state, "A") == []
    assert verify(enumerate(d.log, start=1)).ok


def test_a_restart_forgets_failed_loads() -> None:
    d = a_failed_load_of_a()
    d.restart()
    assert d.state.load_failures == {}
