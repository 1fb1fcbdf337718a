"""ScoreQueue against a brute-force reference in exact rational arithmetic.

The reference scores every waiting request at `now` as

    priority + (bonus if its model is resident) + Fraction(now - enqueued_ns, divisor_ns)

(no aging term when the divisor is 0) and breaks ties by arrival order. Random programs
of enqueue, re-queue, cancel, dispatch (pick + remove), resident changes and clock moves
must give the same winner, runner-up, without-aging and without-affinity winner every time.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from app.core.queue import Queued, ScoreQueue
from app.core.scoring import NS_PER_S, ScoringParams

MODELS = ["m0", "m1", "m2", "m3"]
TIERS = [102, 101, 100, 50, 49, 2, 1, 0, -1, -49, -50, -98, -99, -100]
HUGE = [10**30, 10**30 + 1, -(10**30), -(10**30) - 1, 2**63, -(2**63)]

priorities = st.one_of(
    st.sampled_from(TIERS),
    st.integers(-300, 300),
    st.sampled_from(HUGE),
)
divisors = st.one_of(
    st.just(0),
    st.sampled_from([1, 7, NS_PER_S // 2, NS_PER_S, 3 * NS_PER_S // 2, 60 * NS_PER_S]),
    st.integers(1, 10**12),
)


def reference_ranking(
    items: list[Queued],
    params: ScoringParams,
    resident: str | None,
    now: int,
    *,
    aging: bool = True,
    affinity: bool = True,
) -> list[Queued]:
    def score(q: Queued) -> Fraction:
        s = Fraction(q.priority)
        if affinity and q.model == resident:
            s += params.swap_affinity_bonus
        if aging and params.aging_divisor_ns:
            s += Fraction(now - q.enqueued_ns, params.aging_divisor_ns)
        return s

    return sorted(items, key=lambda q: (-score(q), q.order))


class QueueAgainstReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.queue = ScoreQueue(ScoringParams())
        self.params = ScoringParams()
        self.live: dict[str, Queued] = {}
        self.gone: list[str] = []  # ids cancelled or dispatched, reusable for re-queues
        self.resident: str | None = None
        self.now = 1_700_000_000 * NS_PER_S
        self.order = 0
        self.next_id = 0

    @initialize(divisor=divisors, bonus=st.integers(0, 99), resident=st.sampled_from(MODELS))
    def setup(self, divisor: int, bonus: int, resident: str) -> None:
        self.params = ScoringParams(aging_divisor_ns=divisor, swap_affinity_bonus=bonus)
        self.queue = ScoreQueue(self.params)
        self.resident = resident

    # -- helpers ----------------------------------------------------------

    def _push(self, request_id: str, model: str, priority: int, at: int) -> None:
        item = Queued(request_id, model, priority, at, self.order)
        self.order += 1
        self.queue.push(item)
        self.live[request_id] = item

    def _pick_id(self, index: int) -> str:
        return list(self.live)[index % len(self.live)]

    def _check(self) -> None:
        items = list(self.live.values())
        pick = self.queue.pick(self.resident)
        if not items:
            assert pick is None
            return
        assert pick is not None
        full = reference_ranking(items, self.params, self.resident, self.now)
        no_aging = reference_ranking(items, self.params, self.resident, self.now, aging=False)
        no_affinity = reference_ranking(items, self.params, self.resident, self.now, affinity=False)
        assert pick.winner == full[0]
        assert pick.runner_up == (full[1] if len(full) > 1 else None)
        assert pick.without_aging == no_aging[0]
        assert pick.without_affinity == no_affinity[0]
        assert self.queue.best(self.resident) == full[0]

    # -- rules --------------------------------------------------------------

    @rule(
        model=st.sampled_from(MODELS),
        priority=priorities,
        arbitrary_time=st.one_of(st.none(), st.integers(-(10**15), 10**19)),
    )
    def enqueue(self, model: str, priority: int, arbitrary_time: int | None) -> None:
        """Usually at `now` (non-decreasing times); sometimes at any time at all."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._push(rid, model, priority, self.now if arbitrary_time is None else arbitrary_time)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6), priority=st.one_of(st.none(), priorities))
    def requeue(self, index: int, priority: int | None) -> None:
        """Take a waiting request out and queue it again under the same id (new order)."""
        rid = self._pick_id(index)
        item = self.queue.remove(rid)
        assert item == self.live.pop(rid)
        new_priority = item.priority if priority is None else priority
        self._push(rid, item.model, new_priority, item.enqueued_ns)

    @precondition(lambda self: self.gone)
    @rule(index=st.integers(0, 10**6), model=st.sampled_from(MODELS), priority=priorities)
    def enqueue_a_finished_id_again(self, index: int, model: str, priority: int) -> None:
        rid = self.gone.pop(index % len(self.gone))
        self._push(rid, model, priority, self.now)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6))
    def cancel(self, index: int) -> None:
        rid = self._pick_id(index)
        assert self.queue.remove(rid) == self.live.pop(rid)
        self.gone.append(rid)

    @rule()
    def cancel_unknown(self) -> None:
        assert self.queue.remove("never-queued") is None

    @rule()
    def dispatch(self) -> None:
        self._check()
        pick = self.queue.pick(self.resident)
        if pick is None:
            return
        rid = pick.winner.request_id
        assert self.queue.remove(rid) == self.live.pop(rid)
        self.gone.append(rid)

    @rule(resident=st.one_of(st.none(), st.sampled_from(MODELS)))
    def change_resident(self, resident: str | None) -> None:
        self.resident = resident

    @rule(
        points=st.integers(0, 400),
        nudge=st.sampled_from([-1, 0, 0, 1]),
        raw=st.integers(0, 10**12),
        use_raw=st.booleans(),
    )
    def advance(self, points: int, nudge: int, raw: int, use_raw: bool) -> None:
        """Whole divisors (+/- 1 ns, to land on and beside exact ties) or any span."""
        step = raw if use_raw else max(0, points * self.params.aging_divisor_ns + nudge)
        self.now += step

    # -- invariants -------------------------------------------------------------

    @invariant()
    def agrees_with_reference(self) -> None:
        self._check()
        assert len(self.queue) == len(self.live)
        assert {q.request_id for q in self.queue} == set(self.live)

    @invariant()
    def dead_entry_count_matches_the_heaps(self) -> None:
        entries = sum(len(h.aging) + len(h.plain) for h in self.queue._models.values())
        assert entries == 2 * len(self.queue) + self.queue._dead

    @precondition(lambda self: len(self.live) <= 60)
    @invariant()
    def ranked_is_the_reference_order(self) -> None:
        items = list(self.live.values())
        expected = reference_ranking(items, self.params, self.resident, self.now)
        assert self.queue.ranked(self.resident) == expected


QueueAgainstReference.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQueueAgainstReference = QueueAgainstReference.TestCase
