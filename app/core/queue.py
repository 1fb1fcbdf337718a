"""The waiting queue: O(log n) enqueue, cancel and pick, with exact ordering.

One set of heaps per lane: a lane is a model, or a (model, caller) pair when the
fair-share term is on, because that term is the same for every request of one
caller. The `aging` heap orders by the integer key of `ScoringParams.base_key`
(priority, short job and aging: fixed at enqueue); `plain` leaves out aging and
`noshort` the short-job term, which answer "who would have won without it". The
pick compares each lane's best, adding the bonus to the resident model's lanes
and each caller's fair-share term (which moves as callers are charged, so it is
never in a heap key); lanes are few (models x active callers), so that scan is
cheap next to the heap operations.

Cancel is lazy: the entry is forgotten in `_live` and skipped when it reaches
a heap top; the heaps are rebuilt when dead entries outnumber live ones, so
memory stays proportional to the queue.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

import msgspec

from app.core.scoring import ScoringParams


class Queued(msgspec.Struct, frozen=True):
    """A waiting request as the queue sees it. `order` is arrival order (ties)."""

    request_id: str
    model: str
    priority: int
    enqueued_ns: int
    order: int
    caller: str | None = None
    expected_run_ns: int | None = None


class Pick(msgspec.Struct, frozen=True):
    """The winner of one decision, and the counterfactual winners."""

    winner: Queued
    runner_up: Queued | None
    without_aging: Queued
    without_affinity: Queued
    without_fair_share: Queued
    without_short_job: Queued


FairKeys = Mapping[str | None, int]
"""Each active caller's fair-share term in key units (`SchedulerState.fair_keys`)."""
_NO_FAIR: FairKeys = {}

# Heap entries are (negated key, order, request_id): min-heap = best first,
# equal keys fall back to arrival order.
_Entry = tuple[int, int, str]


class _Lane:
    __slots__ = ("aging", "caller", "live", "model", "noshort", "plain")

    def __init__(self, model: str, caller: str | None) -> None:
        self.model = model
        self.caller = caller
        self.live = 0
        """Live requests in it: an empty lane is dropped, so a pick scans only
        the lanes of callers with waiting work."""
        self.aging: list[_Entry] = []
        self.plain: list[_Entry] = []
        self.noshort: list[_Entry] = []
        """Only filled when the short-job term is on; else `aging` answers."""


class ScoreQueue:
    """Waiting requests of every model, ordered by score."""

    def __init__(self, params: ScoringParams) -> None:
        self.params = params
        self._live: dict[str, Queued] = {}
        self._lanes: dict[tuple[str, str | None], _Lane] = {}
        self._dead = 0
        self._by_caller = params.fair_share_bonus != 0
        self._short = params.short_job_bonus != 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[Queued]:
        return iter(self._live.values())

    def get(self, request_id: str) -> Queued | None:
        return self._live.get(request_id)

    def push(self, item: Queued) -> None:
        if item.request_id in self._live:
            raise ValueError(f"request {item.request_id} is already queued")
        self._live[item.request_id] = item
        caller = item.caller if self._by_caller else None
        lane = self._lanes.get((item.model, caller))
        if lane is None:
            lane = self._lanes[(item.model, caller)] = _Lane(item.model, caller)
        lane.live += 1
        # base_key and plain_key, inlined: push is on every enqueue and replay step.
        params = self.params
        short = params.short_job_key(item.expected_run_ns) if self._short else 0
        plain = item.priority * params.scale + short
        key = plain if params.aging_divisor_ns == 0 else plain - item.enqueued_ns
        order, rid = item.order, item.request_id
        heapq.heappush(lane.aging, (-key, order, rid))
        heapq.heappush(lane.plain, (-plain, order, rid))
        if self._short:
            heapq.heappush(lane.noshort, (short - key, order, rid))

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out (cancel or dispatch); None when it is not queued."""
        item = self._live.pop(request_id, None)
        if item is None:
            return None
        per_request = 3 if self._short else 2  # one entry in each heap
        lane_key = (item.model, item.caller if self._by_caller else None)
        lane = self._lanes[lane_key]
        lane.live -= 1
        if lane.live == 0:
            # Every entry left in it is dead: drop them with the lane.
            del self._lanes[lane_key]
            self._dead += per_request - len(lane.aging) - len(lane.plain) - len(lane.noshort)
        else:
            self._dead += per_request
        if self._dead > 2048 and self._dead > per_request * len(self._live):
            self._compact()
        return item

    def models(self) -> list[str]:
        """Models with at least one waiting request."""
        return list(
            dict.fromkeys(lane.model for lane in self._lanes.values() if self._top(lane.aging))
        )

    def best(self, resident: str | None, fair: FairKeys = _NO_FAIR) -> Queued | None:
        """The request that would be dispatched now."""
        bonus = self.params.affinity_key()
        by_caller = self._by_caller
        live = self._live
        best_k, best_o, best_id = 1 << 200, 0, ""
        for lane in self._lanes.values():
            heap = lane.aging
            top = heap[0]
            item = live.get(top[2])
            if item is None or item.order != top[1]:
                top = self._live_top(heap)  # a lane with no live request is dropped
            k = top[0] - (bonus if lane.model == resident else 0)
            if by_caller:
                k -= fair.get(lane.caller, 0)
            if k < best_k or (k == best_k and top[1] < best_o):
                best_k, best_o, best_id = k, top[1], top[2]
        return live[best_id] if best_id else None

    def pick(self, resident: str | None, fair: FairKeys = _NO_FAIR) -> Pick | None:
        """The winner, the runner-up and the winners without each term."""
        # One pass over the lanes answers every question. A candidate is (negated
        # key, arrival order): the smallest wins, exactly as `best`; kept as two
        # ints per question rather than tuples, since this loop runs per dispatch.
        bonus = self.params.affinity_key()
        short = self._short
        by_caller = self._by_caller
        live = self._live
        top_of = self._live_top
        big = 1 << 200  # beyond any key: "no candidate yet"
        tops: list[tuple[_Lane, int, _Entry]] = []
        win_k = aging_k = aff_k = fair_k = short_k = big
        win_o = aging_o = aff_o = fair_o = short_o = 0
        win_id = aging_id = aff_id = fair_id = short_id = ""
        win_lane: _Lane | None = None
        for lane in self._lanes.values():
            heap = lane.aging
            top = heap[0]
            item = live.get(top[2])
            if item is None or item.order != top[1]:
                top = top_of(heap)  # a lane with no live request is dropped
            plain = lane.plain[0]
            item = live.get(plain[2])
            if item is None or item.order != plain[1]:
                plain = top_of(lane.plain)  # every heap of a lane holds the same requests
            aff = bonus if lane.model == resident else 0
            fair_key = fair.get(lane.caller, 0) if by_caller else 0
            adjust = aff + fair_key
            tops.append((lane, adjust, top))
            key, order = top[0], top[1]
            k = key - adjust
            if k < win_k or (k == win_k and order < win_o):
                win_k, win_o, win_id, win_lane = k, order, top[2], lane
            k = key - fair_key
            if k < aff_k or (k == aff_k and order < aff_o):
                aff_k, aff_o, aff_id = k, order, top[2]
            if by_caller:
                k = key - aff
                if k < fair_k or (k == fair_k and order < fair_o):
                    fair_k, fair_o, fair_id = k, order, top[2]
            k = plain[0] - adjust
            if k < aging_k or (k == aging_k and plain[1] < aging_o):
                aging_k, aging_o, aging_id = k, plain[1], plain[2]
            if short:
                bare = lane.noshort[0]
                item = live.get(bare[2])
                if item is None or item.order != bare[1]:
                    bare = top_of(lane.noshort)
                k = bare[0] - adjust
                if k < short_k or (k == short_k and bare[1] < short_o):
                    short_k, short_o, short_id = k, bare[1], bare[2]
        if win_lane is None:
            return None
        runner: _Entry | None = None
        for lane, adjust, top in tops:
            entry = self._second(lane.aging) if lane is win_lane else top
            if entry is None:
                continue
            cand = (entry[0] - adjust, entry[1], entry[2])
            if runner is None or cand < runner:
                runner = cand
        winner = live[win_id]
        return Pick(
            winner=winner,
            runner_up=None if runner is None else live[runner[2]],
            without_aging=live[aging_id],
            without_affinity=live[aff_id],
            without_fair_share=live[fair_id] if by_caller else winner,
            without_short_job=live[short_id] if short else winner,
        )

    def lane_heaps(self) -> list[tuple[str, str | None, list[_Entry]]]:
        """(model, caller, a heap of its live entries) per lane: a copy a reader may
        pop to follow dispatch order without touching the queue (O(n))."""
        live = self._live
        out = []
        for lane in self._lanes.values():
            heap = [e for e in lane.aging if (q := live.get(e[2])) is not None and q.order == e[1]]
            heapq.heapify(heap)
            out.append((lane.model, lane.caller, heap))
        return out

    def ranked(self, resident: str | None, fair: FairKeys = _NO_FAIR) -> list[Queued]:
        """Every waiting request in dispatch order as of now (O(n log n), for reports)."""
        return sorted(self._live.values(), key=lambda q: self._rank_key(q, resident, fair))

    def position(
        self, request_id: str, resident: str | None, fair: FairKeys = _NO_FAIR
    ) -> int | None:
        """0-based place in dispatch order as of now (O(n), no sort); None if not queued."""
        item = self._live.get(request_id)
        if item is None:
            return None
        mine = self._rank_key(item, resident, fair)
        return sum(1 for q in self._live.values() if self._rank_key(q, resident, fair) < mine)

    def leading(self, count: int, resident: str | None, fair: FairKeys = _NO_FAIR) -> list[Queued]:
        """The first `count` of `ranked` (O(n log count))."""
        return heapq.nsmallest(
            count, self._live.values(), key=lambda q: self._rank_key(q, resident, fair)
        )

    def _rank_key(self, q: Queued, resident: str | None, fair: FairKeys) -> tuple[int, int]:
        key = self.params.base_key(q.priority, q.enqueued_ns, q.expected_run_ns)
        if q.model == resident:
            key += self.params.affinity_key()
        if self._by_caller:
            key += fair.get(q.caller, 0)
        return (-key, q.order)

    # -- internals ---------------------------------------------------------

    def _top(self, heap: list[_Entry]) -> _Entry | None:
        while heap:
            entry = heap[0]
            item = self._live.get(entry[2])
            if item is not None and item.order == entry[1]:
                return entry
            heapq.heappop(heap)
            self._dead -= 1
        return None

    def _live_top(self, heap: list[_Entry]) -> _Entry:
        """`_top` of a heap known to hold a live entry."""
        top = self._top(heap)
        assert top is not None
        return top

    def _second(self, heap: list[_Entry]) -> _Entry | None:
        """Best live entry below the (live) top, searching past dead entries."""
        if self._top(heap) is None:
            return None
        # Usual case: both children of the top are live, and the better one is second.
        live = self._live
        n = len(heap)
        if n < 2:
            return None
        a = heap[1]
        qa = live.get(a[2])
        if qa is not None and qa.order == a[1]:
            if n == 2:
                return a
            b = heap[2]
            qb = live.get(b[2])
            if qb is not None and qb.order == b[1]:
                return a if a < b else b
        frontier: list[tuple[_Entry, int]] = [(heap[i], i) for i in (1, 2) if i < len(heap)]
        heapq.heapify(frontier)
        while frontier:
            entry, i = heapq.heappop(frontier)
            item = self._live.get(entry[2])
            if item is not None and item.order == entry[1]:
                return entry
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))
        return None

    def _compact(self) -> None:
        live = self._live
        for lane in self._lanes.values():
            for heap in (lane.aging, lane.plain, lane.noshort):
                # Match the order too: a re-queued id's old entries are dead.
                heap[:] = [e for e in heap if (q := live.get(e[2])) is not None and q.order == e[1]]
                heapq.heapify(heap)
        self._lanes = {k: lane for k, lane in self._lanes.items() if lane.aging}
        self._dead = 0
