"""The waiting queue: O(log n) enqueue, cancel and pick, with exact ordering.

One pair of heaps per model. The `aging` heap orders by the integer key of
`ScoringParams.base_key` (fixed at enqueue); the `plain` heap orders by
priority alone, which answers "who would have won without aging". The global
pick compares each model's best, adding the bonus to the resident model's;
models are few, so that scan is cheap next to the heap operations.

Cancel is lazy: the entry is forgotten in `_live` and skipped when it reaches
a heap top; the heaps are rebuilt when dead entries outnumber live ones, so
memory stays proportional to the queue.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import msgspec

from app.core.scoring import ScoringParams


class Queued(msgspec.Struct, frozen=True):
    """A waiting request as the queue sees it. `order` is arrival order (ties)."""

    request_id: str
    model: str
    priority: int
    enqueued_ns: int
    order: int


class Pick(msgspec.Struct, frozen=True):
    """The winner of one decision, and the counterfactual winners."""

    winner: Queued
    runner_up: Queued | None
    without_aging: Queued
    without_affinity: Queued


# Heap entries are (negated key, order, request_id): min-heap = best first,
# equal keys fall back to arrival order.
_Entry = tuple[int, int, str]


class _ModelHeaps:
    __slots__ = ("aging", "plain")

    def __init__(self) -> None:
        self.aging: list[_Entry] = []
        self.plain: list[_Entry] = []


class ScoreQueue:
    """Waiting requests of every model, ordered by score."""

    def __init__(self, params: ScoringParams) -> None:
        self.params = params
        self._live: dict[str, Queued] = {}
        self._models: dict[str, _ModelHeaps] = {}
        self._dead = 0

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
        heaps = self._models.get(item.model)
        if heaps is None:
            heaps = self._models[item.model] = _ModelHeaps()
        key = self.params.base_key(item.priority, item.enqueued_ns)
        heapq.heappush(heaps.aging, (-key, item.order, item.request_id))
        heapq.heappush(heaps.plain, (-item.priority, item.order, item.request_id))

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out (cancel or dispatch); None when it is not queued."""
        item = self._live.pop(request_id, None)
        if item is None:
            return None
        self._dead += 2  # one entry in each heap
        if self._dead > 2048 and self._dead > 2 * len(self._live):
            self._compact()
        return item

    def models(self) -> list[str]:
        """Models with at least one waiting request."""
        return [m for m, h in self._models.items() if self._top(h.aging) is not None]

    def best(self, resident: str | None) -> Queued | None:
        """The request that would be dispatched now."""
        best = self._best(resident, aging=True, affinity=True)
        return None if best is None else self._live[best[2]]

    def pick(self, resident: str | None) -> Pick | None:
        """The winner, the runner-up and the winners without aging and without affinity."""
        # One pass over the models answers all three questions; each candidate tuple
        # is (negated key, arrival order, id), the smallest wins, exactly as `_best`.
        bonus = self.params.affinity_key()
        plain_bonus = self.params.swap_affinity_bonus  # the plain heap's keys are bare priorities
        tops: list[tuple[_ModelHeaps, bool, _Entry]] = []
        win: _Entry | None = None
        win_heaps: _ModelHeaps | None = None
        no_aging: _Entry | None = None
        no_affinity: _Entry | None = None
        for model, heaps in self._models.items():
            top = self._top(heaps.aging)
            if top is None:
                continue
            plain = self._top(heaps.plain)
            assert plain is not None  # both heaps hold the same live requests
            is_resident = model == resident
            if is_resident:
                cand = (top[0] - bonus, top[1], top[2])
                plain = (plain[0] - plain_bonus, plain[1], plain[2])
            else:
                cand = top
            tops.append((heaps, is_resident, cand))
            if win is None or cand < win:
                win, win_heaps = cand, heaps
            if no_aging is None or plain < no_aging:
                no_aging = plain
            if no_affinity is None or top < no_affinity:
                no_affinity = top
        if win is None:
            return None
        assert no_aging is not None and no_affinity is not None
        runner: _Entry | None = None
        for heaps, is_resident, cand in tops:
            if heaps is win_heaps:
                second = self._second(heaps.aging)
                if second is None:
                    continue
                cand = (second[0] - bonus, second[1], second[2]) if is_resident else second
            if runner is None or cand < runner:
                runner = cand
        live = self._live
        return Pick(
            winner=live[win[2]],
            runner_up=None if runner is None else live[runner[2]],
            without_aging=live[no_aging[2]],
            without_affinity=live[no_affinity[2]],
        )

    def ranked(self, resident: str | None) -> list[Queued]:
        """Every waiting request in dispatch order as of now (O(n log n), for reports)."""
        return sorted(self._live.values(), key=lambda q: self._rank_key(q, resident))

    def position(self, request_id: str, resident: str | None) -> int | None:
        """0-based place in dispatch order as of now (O(n), no sort); None if not queued."""
        item = self._live.get(request_id)
        if item is None:
            return None
        mine = self._rank_key(item, resident)
        return sum(1 for q in self._live.values() if self._rank_key(q, resident) < mine)

    def _rank_key(self, q: Queued, resident: str | None) -> tuple[int, int]:
        key = self.params.base_key(q.priority, q.enqueued_ns)
        if q.model == resident:
            key += self.params.affinity_key()
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

    def _best(self, resident: str | None, *, aging: bool, affinity: bool) -> _Entry | None:
        # The plain heap's keys are bare priorities, so its bonus is unscaled.
        bonus = self.params.affinity_key() if aging else self.params.swap_affinity_bonus
        best: tuple[int, int, str] | None = None
        for model, heaps in self._models.items():
            top = self._top(heaps.aging if aging else heaps.plain)
            if top is None:
                continue
            key = -top[0]
            if affinity and model == resident:
                key += bonus
            cand = (-key, top[1], top[2])
            if best is None or cand < best:
                best = cand
        return best

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
        for heaps in self._models.values():
            for heap in (heaps.aging, heaps.plain):
                # Match the order too: a re-queued id's old entries are dead.
                heap[:] = [e for e in heap if (q := live.get(e[2])) is not None and q.order == e[1]]
                heapq.heapify(heap)
        self._models = {m: h for m, h in self._models.items() if h.aging}
        self._dead = 0
