"""ScoreQueue against a brute-force reference in exact rational arithmetic.

The reference scores every waiting request at `now` as

    priority + (bonus if its model is resident) + fair share + short job
             + Fraction(now - enqueued_ns, divisor_ns)

(no aging term when the divisor is 0; the fair-share and short-job terms are the
params' integer key units over the scale) and breaks ties by arrival order. Random
programs of enqueue, re-queue, cancel, dispatch (pick + remove), resident changes,
callers' fair-share terms moving and clock moves must give the same winner,
runner-up and winner without each term every time.
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
CALLERS = [None, "a", "b", "c"]
RUNS = [None, 0, 1, 6 * NS_PER_S, 60 * NS_PER_S, 960 * NS_PER_S]
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
    fair: dict[str | None, int] | None = None,
    *,
    aging: bool = True,
    affinity: bool = True,
    fair_share: bool = True,
    short_job: bool = True,
) -> list[Queued]:
    def score(q: Queued) -> Fraction:
        s = Fraction(q.priority)
        if affinity and q.model == resident:
            s += params.swap_affinity_bonus
        if aging and params.aging_divisor_ns:
            s += Fraction(now - q.enqueued_ns, params.aging_divisor_ns)
        if fair_share and fair and params.fair_share_bonus:
            s += Fraction(fair.get(q.caller, 0), params.scale)
        if short_job:
            s += Fraction(params.short_job_key(q.expected_run_ns), params.scale)
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
        self.fair: dict[str | None, int] = {}

    @initialize(
        divisor=divisors,
        bonus=st.integers(0, 99),
        fair=st.sampled_from([0, 0, 1, 20, 99]),
        short=st.sampled_from([0, 0, 1, 20, 99]),
        resident=st.sampled_from(MODELS),
    )
    def setup(self, divisor: int, bonus: int, fair: int, short: int, resident: str) -> None:
        self.params = ScoringParams(
            aging_divisor_ns=divisor,
            swap_affinity_bonus=bonus,
            fair_share_bonus=fair,
            short_job_bonus=short,
        )
        self.queue = ScoreQueue(self.params)
        self.resident = resident

    # -- helpers ----------------------------------------------------------

    def _push(
        self,
        request_id: str,
        model: str,
        priority: int,
        at: int,
        caller: str | None = None,
        run: int | None = None,
    ) -> None:
        item = Queued(request_id, model, priority, at, self.order, caller, run)
        self.order += 1
        self.queue.push(item)
        self.live[request_id] = item

    def _pick_id(self, index: int) -> str:
        return list(self.live)[index % len(self.live)]

    def _check(self) -> None:
        items = list(self.live.values())
        pick = self.queue.pick(self.resident, self.fair)
        if not items:
            assert pick is None
            return
        assert pick is not None

        def ranking(**without: bool) -> list[Queued]:
            return reference_ranking(
                items, self.params, self.resident, self.now, self.fair, **without
            )

        full = ranking()
        assert pick.winner == full[0]
        assert pick.runner_up == (full[1] if len(full) > 1 else None)
        assert pick.without_aging == ranking(aging=False)[0]
        assert pick.without_affinity == ranking(affinity=False)[0]
        assert pick.without_fair_share == ranking(fair_share=False)[0]
        assert pick.without_short_job == ranking(short_job=False)[0]
        assert self.queue.best(self.resident, self.fair) == full[0]

    # -- rules --------------------------------------------------------------

    @rule(
        model=st.sampled_from(MODELS),
        priority=priorities,
        arbitrary_time=st.one_of(st.none(), st.integers(-(10**15), 10**19)),
        caller=st.sampled_from(CALLERS),
        run=st.one_of(st.sampled_from(RUNS), st.integers(0, 10**13)),
    )
    def enqueue(
        self,
        model: str,
        priority: int,
        arbitrary_time: int | None,
        caller: str | None,
        run: int | None,
    ) -> None:
        """Usually at `now` (non-decreasing times); sometimes at any time at all."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        at = self.now if arbitrary_time is None else arbitrary_time
        self._push(rid, model, priority, at, caller, run)

    @rule(
        keys=st.lists(st.integers(0, 100), min_size=len(CALLERS), max_size=len(CALLERS)),
    )
    def charge_callers(self, keys: list[int]) -> None:
        """Callers' fair-share terms move between decisions (0..bonus points)."""
        full = self.params.fair_share_bonus * self.params.scale
        self.fair = {c: full * k // 100 for c, k in zip(CALLERS, keys, strict=True)}

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6), priority=st.one_of(st.none(), priorities))
    def requeue(self, index: int, priority: int | None) -> None:
        """Take a waiting request out and queue it again under the same id (new order)."""
        rid = self._pick_id(index)
        item = self.queue.remove(rid)
        assert item == self.live.pop(rid)
        new_priority = item.priority if priority is None else priority
        self._push(
            rid, item.model, new_priority, item.enqueued_ns, item.caller, item.expected_run_ns
        )

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
        lanes = self.queue._lanes.values()
        entries = sum(len(h.aging) + len(h.plain) + len(h.noshort) for h in lanes)
        # One entry per heap kept: aging always, plain with aging on, noshort with short.
        per_request = 1 + (self.params.aging_divisor_ns != 0) + (self.params.short_job_bonus != 0)
        assert entries == per_request * len(self.queue) + self.queue._dead

    @invariant()
    def every_heap_top_is_live(self) -> None:
        # A pick reads tops unchecked: `remove` must have popped every dead one.
        live_orders = {q.order for q in self.live.values()}
        for lane in self.queue._lanes.values():
            for heap in lane.heaps:
                assert heap[0] & ((1 << 48) - 1) in live_orders

    @precondition(lambda self: len(self.live) <= 60)
    @invariant()
    def ranked_is_the_reference_order(self) -> None:
        items = list(self.live.values())
        expected = reference_ranking(items, self.params, self.resident, self.now, self.fair)
        assert self.queue.ranked(self.resident, self.fair) == expected


QueueAgainstReference.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQueueAgainstReference = QueueAgainstReference.TestCase
