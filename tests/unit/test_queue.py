"""ScoreQueue: exact O(log n) ordering, cancel, runner-up and counterfactual winners."""

from __future__ import annotations

import random

import pytest

from app.core.queue import Queued, ScoreQueue
from app.core.scoring import NS_PER_S, ScoringParams

S = NS_PER_S
MIN = 60 * S


class Builder:
    """Pushes requests with increasing arrival order; times are in ns from 0."""

    def __init__(self, params: ScoringParams | None = None) -> None:
        self.q = ScoreQueue(params or ScoringParams())
        self.order = 0

    def push(self, request_id: str, model: str, priority: int = 0, at: int = 0) -> Queued:
        item = Queued(request_id, model, priority, at, self.order)
        self.order += 1
        self.q.push(item)
        return item


def ids(items: list[Queued]) -> list[str]:
    return [q.request_id for q in items]


def drain(q: ScoreQueue, resident: str | None) -> list[str]:
    out = []
    while (p := q.pick(resident)) is not None:
        assert q.remove(p.winner.request_id) == p.winner
        out.append(p.winner.request_id)
    return out


def assert_pick_matches_ranked(q: ScoreQueue, resident: str | None) -> None:
    ranked = q.ranked(resident)
    p = q.pick(resident)
    if not ranked:
        assert p is None
        return
    assert p is not None
    assert p.winner == ranked[0] == q.best(resident)
    assert p.runner_up == (ranked[1] if len(ranked) > 1 else None)


def heap_entries(q: ScoreQueue) -> int:
    return sum(len(h.aging) + len(h.plain) + len(h.noshort) for h in q._lanes.values())


# -- empty, push, cancel ------------------------------------------------------


def test_empty_queue_has_no_best_and_no_pick() -> None:
    q = ScoreQueue(ScoringParams())
    assert q.best("a") is None
    assert q.pick(None) is None
    assert q.ranked("a") == []
    assert len(q) == 0
    assert q.models() == []


def test_pushing_an_id_already_queued_is_an_error() -> None:
    b = Builder()
    b.push("r1", "a")
    with pytest.raises(ValueError, match="already queued"):
        b.push("r1", "b")


def test_cancel_removes_the_request_from_every_answer() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    r1 = b.push("r1", "a", 0, at=0)
    b.push("r2", "a", 100, at=1 * S)
    b.push("r3", "b", 0, at=2 * S)
    assert b.q.best("a") is not None and b.q.best("a").request_id == "r2"

    removed = b.q.remove("r2")

    assert removed is not None and removed.request_id == "r2"
    assert len(b.q) == 2
    assert "r2" not in b.q
    assert b.q.get("r2") is None
    assert ids(list(b.q)) == ["r1", "r3"]
    p = b.q.pick("a")
    assert p is not None
    assert p.winner == r1
    assert p.runner_up is not None and p.runner_up.request_id == "r3"
    assert p.without_aging == r1 and p.without_affinity == r1
    assert ids(b.q.ranked("a")) == ["r1", "r3"]


def test_cancel_of_an_unknown_id_returns_none_and_changes_nothing() -> None:
    b = Builder()
    b.push("r1", "a")
    assert b.q.remove("nope") is None
    assert len(b.q) == 1
    assert b.q.remove("r1") is not None
    assert b.q.remove("r1") is None  # a second cancel of the same id
    assert len(b.q) == 0
    assert b.q.pick("a") is None


def test_cancelling_every_request_of_a_model_drops_it_from_models() -> None:
    b = Builder()
    b.push("a1", "a")
    b.push("b1", "b")
    assert sorted(b.q.models()) == ["a", "b"]
    b.q.remove("a1")
    assert b.q.models() == ["b"]


def test_a_cancelled_id_can_be_queued_again_and_only_its_new_entry_counts() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=0))
    b.push("r1", "a", 100, at=0)
    b.push("r2", "a", 0, at=0)
    b.q.remove("r1")
    b.push("r1", "a", -100, at=0)  # re-queued at a lower priority
    assert drain(b.q, "a") == ["r2", "r1"]


# -- single pick, runner-up ---------------------------------------------------


def test_pick_of_a_single_request_has_no_runner_up_and_it_is_every_counterfactual() -> None:
    b = Builder()
    only = b.push("r1", "a")
    p = b.q.pick("b")
    assert p is not None
    assert p.winner == only
    assert p.runner_up is None
    assert p.without_aging == only and p.without_affinity == only


def test_runner_up_from_the_winners_own_model() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    b.push("a1", "a", 0, at=0)
    b.push("a2", "a", 0, at=1 * S)
    b.push("b1", "b", 0, at=2 * S)
    p = b.q.pick("a")
    assert p is not None
    assert (p.winner.request_id, p.runner_up and p.runner_up.request_id) == ("a1", "a2")


def test_runner_up_from_another_model_counts_the_resident_bonus() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    b.push("a1", "a", 0, at=0)
    b.push("b1", "b", 5, at=0)
    b.push("a2", "a", 0, at=1 * S)
    # resident b: b1 = 15, a1 = 0 + 1/60, a2 = 0
    p = b.q.pick("b")
    assert p is not None
    assert (p.winner.request_id, p.runner_up and p.runner_up.request_id) == ("b1", "a1")
    # resident a: a1 = 10 + 1/60, a2 = 10, b1 = 5
    p = b.q.pick("a")
    assert p is not None
    assert (p.winner.request_id, p.runner_up and p.runner_up.request_id) == ("a1", "a2")


def test_runner_up_skips_cancelled_entries_just_below_the_top() -> None:
    # Cancel the 2nd..200th best of model a without compaction (under 2048 dead
    # entries): the runner-up search must walk past every dead entry in the heap.
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    for i in range(400):
        b.push(f"a{i}", "a", 0, at=i * S)
    b.push("b0", "b", 0, at=150 * S)
    for i in range(1, 200):
        b.q.remove(f"a{i}")
    assert b.q._dead == 2 * 199  # lazy: nothing compacted yet
    p = b.q.pick("a")
    assert p is not None
    assert p.winner.request_id == "a0"
    assert p.runner_up is not None and p.runner_up.request_id == "a200"  # a200 = 10 > b0
    p = b.q.pick("b")
    assert p is not None
    assert p.winner.request_id == "b0"  # 10 - 150/60 beats a0 = 0
    assert p.runner_up is not None and p.runner_up.request_id == "a0"
    assert_pick_matches_ranked(b.q, "a")
    assert_pick_matches_ranked(b.q, None)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pick_and_runner_up_stay_right_after_many_cancels_and_compactions(seed: int) -> None:
    rng = random.Random(seed)
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    models = ["a", "b", "c"]
    tiers = [102, 101, 100, 2, 1, 0, -98, -99, -100]
    live: list[str] = []
    n = 0
    compactions = 0
    for _round in range(4):
        for _ in range(3000):
            rid = f"r{n}"
            b.push(rid, rng.choice(models), rng.choice(tiers), at=n * 100_000_000)
            live.append(rid)
            n += 1
        rng.shuffle(live)
        keep = len(live) // 10
        for rid in live[keep:]:
            dead_before = b.q._dead
            assert b.q.remove(rid) is not None
            compactions += b.q._dead < dead_before
        live = live[:keep]
        # the bookkeeping matches the heaps: every entry is live (2 per request) or dead
        assert heap_entries(b.q) == 2 * len(b.q) + b.q._dead
        for resident in [None, *models]:
            assert_pick_matches_ranked(b.q, resident)
    assert compactions >= 3
    resident = "b"
    expected = ids(b.q.ranked(resident))
    assert drain(b.q, resident) == expected


def test_compaction_drops_the_old_entries_of_a_requeued_id() -> None:
    # The scheduler re-queues a request under its own id with a new arrival order
    # (RequestRequeued); its old heap entries are dead even though the id is live.
    b = Builder()
    for i in range(3000):
        b.push(f"r{i}", "a", 0, at=i)
    for k in range(3100):  # enough re-queues to trigger compaction
        item = b.q.remove(f"r{k % 3000}")
        assert item is not None
        b.push(item.request_id, item.model, item.priority, at=item.enqueued_ns)
    assert heap_entries(b.q) == 2 * len(b.q) + b.q._dead
    assert heap_entries(b.q) < 2 * 2 * len(b.q)
    assert_pick_matches_ranked(b.q, "a")


# -- counterfactual winners ----------------------------------------------------


def test_without_aging_winner_is_the_highest_priority_when_aging_decided() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=0))
    old = b.push("old", "a", 0, at=0)
    new = b.push("new", "a", 1, at=2 * MIN)  # old has aged 2 points: 2 > 1
    p = b.q.pick("a")
    assert p is not None
    assert p.winner == old
    assert p.without_aging == new
    assert p.without_affinity == old


def test_without_affinity_winner_is_the_one_that_needs_a_swap() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    other = b.push("other", "b", 5, at=0)
    resident = b.push("resident", "a", 0, at=1 * S)
    p = b.q.pick("a")
    assert p is not None
    assert p.winner == resident  # 10 > 5 + 1/60
    assert p.without_affinity == other
    assert p.without_aging == resident


def test_without_aging_keeps_affinity_and_without_affinity_keeps_aging() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    old = b.push("old", "b", 5, at=0)  # needs a swap, waited 20 min more
    new = b.push("new", "a", 0, at=20 * MIN)  # resident
    b.push("older_low", "b", -90, at=-(60 * MIN))  # 60 points of aging, still loses
    p = b.q.pick("a")
    assert p is not None
    assert p.winner == old  # 5 + 20 > 10
    assert p.without_aging == new  # 10 > 5 (affinity kept)
    assert p.without_affinity == old  # 25 > 0 (aging kept)
    assert p.runner_up == new


def test_without_aging_ties_keep_arrival_order() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=10))
    first = b.push("first", "b", 10, at=0)
    b.push("second", "a", 0, at=5 * MIN)  # resident: 0 + 10 ties first's 10
    p = b.q.pick("a")
    assert p is not None
    assert p.winner == first
    assert p.without_aging == first


# -- ordering -----------------------------------------------------------------


def test_ranked_matches_repeated_picks() -> None:
    rng = random.Random(7)
    b = Builder(ScoringParams(aging_divisor_ns=30 * S, swap_affinity_bonus=10))
    for i in range(500):
        b.push(f"r{i}", rng.choice("abcd"), rng.choice([100, 0, -100, -98, 1, 2]), at=i * S)
    for resident in [None, "a", "d"]:
        ranked = ids(b.q.ranked(resident))
        copy = ScoreQueue(b.q.params)
        for item in b.q:
            copy.push(item)
        assert drain(copy, resident) == ranked
        assert len(b.q) == 500


def test_aging_divisor_0_orders_by_priority_plus_affinity_then_arrival() -> None:
    b = Builder(ScoringParams(aging_divisor_ns=0, swap_affinity_bonus=10))
    b.push("ancient", "a", -100, at=-(10**15))
    b.push("b0", "b", 0, at=0)
    b.push("a0", "a", 0, at=1)
    b.push("b10", "b", 10, at=2)  # ties a0 (0 + bonus 10): a0 arrived first
    assert drain(b.q, "a") == ["a0", "b10", "b0", "ancient"]


def test_huge_priorities_compare_exactly_where_floats_would_tie() -> None:
    assert float(10**30) == float(10**30 + 1)
    b = Builder(ScoringParams(aging_divisor_ns=MIN, swap_affinity_bonus=0))
    b.push("lower", "a", 10**30, at=0)
    b.push("higher", "a", 10**30 + 1, at=MIN - 1)  # 1 point above, 1 ns short of 1 min
    b.push("tied", "a", 10**30 + 1, at=MIN)  # exactly 1 point above, 1 min later: a tie
    assert drain(b.q, "a") == ["higher", "lower", "tied"]


def test_sub_second_divisor_is_exact_at_the_tie() -> None:
    half = S // 2  # agingDivisor 0.5 s: one point per half second
    b = Builder(ScoringParams(aging_divisor_ns=half, swap_affinity_bonus=0))
    b.push("low_early", "a", -1, at=0)
    b.push("high_tied", "a", 0, at=half)  # equal score: arrival order
    b.push("high_before", "b", 0, at=half - 1)  # 1 ns earlier: strictly higher
    assert drain(b.q, None) == ["high_before", "low_early", "high_tied"]
