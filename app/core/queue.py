"""The waiting queue: O(log n) enqueue, cancel and pick, with exact ordering.

One set of heaps per lane: a lane is a model, or a (model, caller) pair when the
fair-share term is on, because that term is the same for every request of one
caller; with the short-job term per (model, endpoint) (`short_by_lane`, log format
3) a lane is also one endpoint, because that term is then the same for every
request of one model and endpoint. The `aging` heap orders by the integer key of
`ScoringParams.base_key` (priority and aging, and the request's own short-job term
when it is per request: fixed at enqueue); `plain` leaves out aging and `noshort`
the per-request short-job term, which answer "who would have won without it" (each
kept only while its term is on). The pick compares each lane's best, adding the
bonus to the resident model's lanes, each caller's fair-share term (which moves as
callers are charged, so it is never in a heap key) and, per lane, the short-job
term of its model and endpoint's current estimate; lanes are few (models x
endpoints x active callers), so that scan is cheap next to the heap operations.

Why per lane: a per-request short-job term is fixed from the estimate at that
request's enqueue, and the estimate drifts as runs complete, so of two identical
requests (same model, endpoint, priority, caller) the later one could get more
points and overtake the earlier one, for ever when aging is off. One current
estimate per (model, endpoint) gives identical requests the same term at every
decision, so they keep arrival order whatever the estimate does.

A heap entry is one int, `(-key << 48) + order`: ordering entries orders by key,
then arrival, and adding a term to a lane's top is one subtraction. An int is
compared in one step and sits in one object, where a (key, order, id) tuple costs
three and a pointer chase each (pick + remove at 1M: 1.8x, `docs/benchmarks.md`).

Cancel is lazy below the top: the entry is forgotten (`_by_order`), and `remove`
pops dead entries off the tops of its lane's heaps, so every top is live and a
pick reads tops without checking them. The heaps are rebuilt when dead entries
outnumber live ones, so memory stays proportional to the queue.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Mapping, Set
from typing import Final

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
    """Its own estimate, recorded at its enqueue: the short-job term's input when
    that term is per request (log formats 1-2)."""
    endpoint: str = ""
    """Its endpoint: with the short-job term per lane, its lane's estimate is that
    of its (model, endpoint)."""


class Pick(msgspec.Struct, frozen=True):
    """The winner of one decision, and the counterfactual winners."""

    winner: Queued
    runner_up: Queued | None
    without_aging: Queued
    without_affinity: Queued
    without_fair_share: Queued
    without_short_job: Queued


Affine = str | Set[str] | None
"""The models whose requests get the swap-affinity bonus: every model in use
(resident or loading; `SchedulerState.in_use`), or one model (or None)."""


def _affine(resident: Affine) -> Set[str] | tuple[str, ...]:
    if resident is None:
        return ()
    if isinstance(resident, str):
        return (resident,)
    return resident


FairKeys = Mapping[str | None, int]
"""Each active caller's fair-share term in key units (`SchedulerState.fair_keys`)."""
NO_FAIR: FairKeys = {}
"""No caller favoured (shared: never mutated)."""

_SHIFT: Final = 48
_ORDER: Final = (1 << _SHIFT) - 1
"""An entry's low bits: its request's arrival order (below 2**48, unique)."""
_NONE: Final = 1 << 1024
"""Beyond any entry: "no candidate yet"."""

_heappush, _heappop = heapq.heappush, heapq.heappop  # bound once: push and remove are hot

_LAZY: Final = 256
"""Entries a lane walk (`lanes_in_order`) takes off its frontier before it sorts
the rest: a first page stays O(k log k), a walk to the end O(n log n) in C."""
_SPARE_LANES: Final = 1024
_SHORT_KEYS: Final = 4096

_Entry = tuple[int, int, str]
"""What `lanes_in_order` hands out: (negated key, order, request id)."""


class _Lane:
    __slots__ = ("aging", "caller", "heaps", "live", "model", "noshort", "plain", "short")

    def __init__(
        self, model: str, caller: str | None, aging: bool, short: bool, cell: list[int]
    ) -> None:
        self.model = model
        self.caller = caller
        self.short = cell
        """One int: the short-job term of its (model, endpoint), shifted to an
        entry's key bits, shared by every lane of that pair and updated as the
        estimate changes (always 0 while the term is per request)."""
        self.live = 0
        """Live requests in it: an empty lane is dropped, so a pick scans only
        the lanes of callers with waiting work."""
        self.aging: list[int] = []
        self.plain: list[int] = []
        """Only filled when aging is on; else `aging` answers."""
        self.noshort: list[int] = []
        """Only filled when the short-job term is on per request; else `aging` answers."""
        self.heaps = (
            (self.aging,) + ((self.plain,) if aging else ()) + ((self.noshort,) if short else ())
        )


class ScoreQueue:
    """Waiting requests of every model, ordered by score."""

    def __init__(self, params: ScoringParams, *, short_by_lane: bool = False) -> None:
        """`short_by_lane`: the short-job term from one current estimate per (model,
        endpoint), the latest `note_estimate` (log format 3); else each request's own
        `expected_run_ns`, fixed at its enqueue (formats 1-2)."""
        self.params = params
        self._live: dict[str, Queued] = {}
        self._by_order: dict[int, Queued] = {}
        """The live entries' requests by order: an entry whose order is not here is dead."""
        self._lanes: dict[tuple[str, str, str | None], _Lane] = {}
        self._spare: dict[tuple[str, str, str | None], _Lane] = {}
        """Emptied lanes kept for reuse: a lane empties whenever its last request
        is dispatched, and comes back with the next one."""
        self._dead = 0
        self._by_caller = params.fair_share_bonus != 0
        self._short = params.short_job_bonus != 0
        self._by_lane = short_by_lane and self._short
        """The short-job term per (model, endpoint), added to lane tops at a pick
        (while it is off, lanes are not split by endpoint)."""
        self._short_heap = self._short and not short_by_lane
        """The short-job term per request, in heap keys (with a `noshort` heap)."""
        self._aging = params.aging_divisor_ns != 0
        self._per_request = 1 + self._aging + self._short_heap
        """Entries a request has, one in each heap of its lane."""
        self._bonus = params.affinity_key() << _SHIFT
        """The swap-affinity bonus, shifted to an entry's key bits."""
        self._scale = params.scale
        self._short_keys: dict[int | None, int] = {}
        """`short_job_key` by expected run time: estimates are medians of recent
        runs, so a few values recur and the division is done once each."""
        self._estimates: dict[tuple[str, str], int] = {}
        """With `short_by_lane`: the current estimate per (model, endpoint)."""
        self._cells: dict[tuple[str, str], list[int]] = {}
        """With `short_by_lane`: per (model, endpoint), its lanes' shared `short`."""
        self._zero = [0]
        """The `short` of every lane while the term is per request or off."""

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[Queued]:
        return iter(self._live.values())

    def get(self, request_id: str) -> Queued | None:
        return self._live.get(request_id)

    def estimates(self) -> dict[tuple[str, str], int]:
        """The current estimate per (model, endpoint) (with `short_by_lane`)."""
        return dict(self._estimates)

    def note_estimate(self, model: str, endpoint: str, expected_run_ns: int | None) -> None:
        """A request of (model, endpoint) was enqueued with this estimate: it becomes
        the one every waiting request of that pair is scored with (with
        `short_by_lane`; None, no history, changes nothing)."""
        if not self._by_lane or expected_run_ns is None:
            return
        key = (model, endpoint)
        if self._estimates.get(key) == expected_run_ns:
            return
        self._estimates[key] = expected_run_ns
        short = self.params.short_job_key(expected_run_ns) << _SHIFT if self._short else 0
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [short]
        else:
            cell[0] = short

    def empty_copy(self) -> ScoreQueue:
        """An empty queue that scores as this one does: the same parameters, and
        the same estimates when the short-job term is per (model, endpoint)."""
        copy = ScoreQueue(self.params, short_by_lane=self._by_lane)
        for (model, endpoint), expected in self._estimates.items():
            copy.note_estimate(model, endpoint, expected)
        return copy

    def snapshot(self) -> ScoreQueue:
        """A copy that stays as this queue is now while this one moves on, for a
        reader that follows it in slices between the run loop's other work: heaps
        and maps copied at C speed (O(n)), the frozen entries shared."""
        copy = self.empty_copy()
        copy._live = dict(self._live)
        copy._by_order = dict(self._by_order)
        copy._dead = self._dead
        for key, lane in self._lanes.items():
            cell = copy._zero
            if self._by_lane:
                cell = copy._cells.setdefault((key[0], key[1]), [lane.short[0]])
            twin = _Lane(lane.model, lane.caller, self._aging, self._short_heap, cell)
            twin.live = lane.live
            for mine, theirs in zip(twin.heaps, lane.heaps, strict=True):
                mine[:] = theirs
            copy._lanes[key] = twin
        return copy

    def expected(self, item: Queued) -> int | None:
        """The expected run time `item` is scored with: its (model, endpoint)'s
        current estimate with `short_by_lane`, else its own."""
        if self._by_lane:
            return self._estimates.get((item.model, item.endpoint))
        return item.expected_run_ns

    def push(self, item: Queued) -> None:
        rid, order = item.request_id, item.order
        if rid in self._live:
            raise ValueError(f"request {rid} is already queued")
        if not 0 <= order <= _ORDER or order in self._by_order:
            raise ValueError(f"order {order} is taken or outside 0..2**48-1")
        self._live[rid] = item
        self._by_order[order] = item
        caller = item.caller if self._by_caller else None
        endpoint = item.endpoint if self._by_lane else ""
        lane_key = (item.model, endpoint, caller)
        lane = self._lanes.get(lane_key)
        if lane is None:
            lane = self._spare.pop(lane_key, None)
            if lane is None:
                cell = self._zero
                if self._by_lane:
                    cell = self._cells.setdefault((item.model, endpoint), [0])
                lane = _Lane(item.model, caller, self._aging, self._short_heap, cell)
            self._lanes[lane_key] = lane
        lane.live += 1
        # base_key and plain_key, inlined: push is on every enqueue and replay step.
        params = self.params
        if self._short_heap:
            expected = item.expected_run_ns
            short = self._short_keys.get(expected)
            if short is None:
                if len(self._short_keys) > _SHORT_KEYS:
                    self._short_keys.clear()
                short = self._short_keys[expected] = params.short_job_key(expected)
        else:
            short = 0
        plain = item.priority * self._scale + short
        if self._aging:
            key = plain - item.enqueued_ns
            _heappush(lane.plain, (-plain << _SHIFT) + order)
        else:
            key = plain
        _heappush(lane.aging, (-key << _SHIFT) + order)
        if self._short_heap:
            _heappush(lane.noshort, ((short - key) << _SHIFT) + order)

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out (cancel or dispatch); None when it is not queued."""
        item = self._live.pop(request_id, None)
        if item is None:
            return None
        by_order = self._by_order
        del by_order[item.order]
        per_request = self._per_request
        lane_key = (
            item.model,
            item.endpoint if self._by_lane else "",
            item.caller if self._by_caller else None,
        )
        lane = self._lanes[lane_key]
        lane.live -= 1
        if lane.live == 0:
            # Every entry left in it is dead: drop them with the lane.
            del self._lanes[lane_key]
            heaps = lane.heaps
            self._dead += per_request - sum(map(len, heaps))
            for heap in heaps:
                heap.clear()
            if len(self._spare) < _SPARE_LANES:
                self._spare[lane_key] = lane
        else:
            # Keep every heap's top live, so a pick reads tops without checking them.
            dead = self._dead + per_request
            for heap in lane.heaps:
                while heap[0] & _ORDER not in by_order:
                    _heappop(heap)
                    dead -= 1
            self._dead = dead
        if self._dead > 2048 and self._dead > per_request * len(self._live):
            self._compact()
        return item

    def models(self) -> list[str]:
        """Models with at least one waiting request."""
        return list(dict.fromkeys(lane.model for lane in self._lanes.values()))

    def best(
        self, resident: Affine, fair: FairKeys = NO_FAIR, skip: Set[str] = frozenset()
    ) -> Queued | None:
        """The request that would be dispatched now (of a model not in `skip`)."""
        bonus = self._bonus
        by_caller = self._by_caller and bool(fair)  # else the term is 0 in every lane
        affine = _affine(resident)
        best = _NONE
        for lane in self._lanes.values():
            if skip and lane.model in skip:
                continue
            entry = lane.aging[0] - lane.short[0]  # live: `remove` keeps it so
            if lane.model in affine:
                entry -= bonus
            if by_caller:
                entry -= fair.get(lane.caller, 0) << _SHIFT
            if entry < best:
                best = entry
        return None if best == _NONE else self._by_order[best & _ORDER]

    def model_order(self, resident: Affine, fair: FairKeys = NO_FAIR) -> list[str]:
        """Models with waiting requests, by their best request's score, best first
        (ties by arrival): the order the dispatch rule considers them in."""
        bonus = self._bonus
        by_caller = self._by_caller and bool(fair)  # else the term is 0 in every lane
        affine = _affine(resident)
        tops: dict[str, int] = {}
        for lane in self._lanes.values():
            entry = lane.aging[0] - lane.short[0]
            if lane.model in affine:
                entry -= bonus
            if by_caller:
                entry -= fair.get(lane.caller, 0) << _SHIFT
            known = tops.get(lane.model)
            if known is None or entry < known:
                tops[lane.model] = entry
        return sorted(tops, key=tops.__getitem__)

    def pick(
        self, resident: Affine, fair: FairKeys = NO_FAIR, skip: Set[str] = frozenset()
    ) -> Pick | None:
        """The winner, the runner-up and the winners without each term, among the
        requests of models not in `skip` (`resident`: the models with affinity)."""
        # One pass over the lanes answers every question: a lane's top minus the
        # terms a question counts (shifted to the key's bits) is that lane's
        # candidate, and the smallest candidate wins, exactly as `best`.
        bonus = self._bonus
        short = self._short
        short_heap = self._short_heap
        by_caller = self._by_caller and bool(fair)  # else the term is 0 in every lane
        aging = self._aging
        win = runner = aging_w = aff_w = fair_w = short_w = _NONE
        win_lane: _Lane | None = None
        win_adjust = fair_key = 0
        affine = _affine(resident)
        for lane in self._lanes.values():
            if skip and lane.model in skip:
                continue
            top = lane.aging[0]
            sj = lane.short[0]  # 0 unless the short-job term is per lane
            aff = bonus if lane.model in affine else 0
            if by_caller:
                fair_key = fair.get(lane.caller, 0) << _SHIFT
            adjust = aff + fair_key + sj
            entry = top - adjust
            if entry < win:
                runner = win  # the old best lane top is now a runner-up candidate
                win, win_lane, win_adjust = entry, lane, adjust
            elif entry < runner:
                runner = entry
            if bonus:
                entry = top - fair_key - sj
                if entry < aff_w:
                    aff_w = entry
            if by_caller:
                entry = top - aff - sj
                if entry < fair_w:
                    fair_w = entry
            if aging:
                entry = lane.plain[0] - adjust
                if entry < aging_w:
                    aging_w = entry
            if short:
                entry = lane.noshort[0] - adjust if short_heap else top - aff - fair_key
                if entry < short_w:
                    short_w = entry
        if win_lane is None:
            return None
        # The runner-up: the best other lane's top, or the second of the winner's lane.
        if len(win_lane.aging) > 1:
            second = self._second(win_lane.aging)
            if second is not None and second - win_adjust < runner:
                runner = second - win_adjust
        by_order = self._by_order
        winner = by_order[win & _ORDER]
        return Pick(
            winner=winner,
            runner_up=None if runner == _NONE else by_order[runner & _ORDER],
            without_aging=by_order[aging_w & _ORDER] if aging else winner,
            without_affinity=by_order[aff_w & _ORDER] if bonus else winner,
            without_fair_share=by_order[fair_w & _ORDER] if by_caller else winner,
            without_short_job=by_order[short_w & _ORDER] if short else winner,
        )

    def lanes_in_order(self) -> list[tuple[str, str | None, Iterator[_Entry]]]:
        """(model, caller, its live entries in dispatch order) per lane, for a reader
        that follows dispatch order without copying or touching the queue: each
        iterator walks its lane's heap best-first (O(log n) a step, nothing read
        before it is asked for), so the first k of 10,000 cost O(k log k). Valid
        only until the queue next changes: consume them before any `await`."""
        return [
            (lane.model, lane.caller, self._walk(lane.aging, lane.short[0]))
            for lane in self._lanes.values()
        ]

    def _walk(self, heap: list[int], short: int) -> Iterator[_Entry]:
        """A heap's live entries, smallest first: a frontier of (entry, index) over
        the heap's tree (a child is never smaller than its parent), dead entries
        skipped but their children still visited; past `_LAZY` entries the rest
        comes from one sort (C speed: a reader that goes far goes to the end)."""
        by_order = self._by_order
        n = len(heap)
        frontier = [(heap[0], 0)] if n else []
        taken = 0
        while frontier:
            entry, i = _heappop(frontier)
            child = 2 * i + 1
            if child < n:
                _heappush(frontier, (heap[child], child))
                if child + 1 < n:
                    _heappush(frontier, (heap[child + 1], child + 1))
            item = by_order.get(entry & _ORDER)
            if item is not None:
                yield ((entry - short) >> _SHIFT, entry & _ORDER, item.request_id)
                taken += 1
                if taken == _LAZY:
                    rest = sorted(heap)
                    for later in rest[bisect.bisect_right(rest, entry) :]:
                        item = by_order.get(later & _ORDER)
                        if item is not None:
                            yield ((later - short) >> _SHIFT, later & _ORDER, item.request_id)
                    return

    def waiting_by_model(self) -> dict[str, int]:
        """Model -> how many wait for it (O(lanes))."""
        counts: dict[str, int] = {}
        for lane in self._lanes.values():
            counts[lane.model] = counts.get(lane.model, 0) + lane.live
        return counts

    def ranked(self, resident: Affine, fair: FairKeys = NO_FAIR) -> list[Queued]:
        """Every waiting request in dispatch order as of now (O(n log n), for reports)."""
        return sorted(self._live.values(), key=lambda q: self._rank_key(q, resident, fair))

    def position(self, request_id: str, resident: Affine, fair: FairKeys = NO_FAIR) -> int | None:
        """0-based place in dispatch order as of now (O(n), no sort); None if not queued."""
        item = self._live.get(request_id)
        if item is None:
            return None
        mine = self._rank_key(item, resident, fair)
        return sum(1 for q in self._live.values() if self._rank_key(q, resident, fair) < mine)

    def ahead(self, item: Queued, resident: Affine, fair: FairKeys = NO_FAIR) -> list[Queued]:
        """The waiting requests that go before `item` as of now (O(n), no sort);
        `item` need not be queued: one about to arrive has `enqueued_ns` now and
        the next order, so it goes after every equal score."""
        mine = self._rank_key(item, resident, fair)
        return [
            q
            for q in self._live.values()
            if q.request_id != item.request_id and self._rank_key(q, resident, fair) < mine
        ]

    def leading(self, count: int, resident: Affine, fair: FairKeys = NO_FAIR) -> list[Queued]:
        """The first `count` of `ranked` (O(n log count))."""
        return heapq.nsmallest(
            count, self._live.values(), key=lambda q: self._rank_key(q, resident, fair)
        )

    def _rank_key(self, q: Queued, resident: Affine, fair: FairKeys) -> tuple[int, int]:
        key = self.params.base_key(q.priority, q.enqueued_ns, self.expected(q))
        if q.model in _affine(resident):
            key += self.params.affinity_key()
        if self._by_caller:
            key += fair.get(q.caller, 0)
        return (-key, q.order)

    # -- internals ---------------------------------------------------------

    def _second(self, heap: list[int]) -> int | None:
        """Best live entry below the (live) top, searching past dead entries."""
        by_order = self._by_order
        n = len(heap)
        # Usual case: both children of the top are live, and the better one is second.
        if n < 2:
            return None
        a = heap[1]
        if a & _ORDER in by_order:
            if n == 2:
                return a
            b = heap[2]
            if b & _ORDER in by_order:
                return a if a < b else b
        frontier: list[tuple[int, int]] = [(heap[i], i) for i in (1, 2) if i < n]
        heapq.heapify(frontier)
        while frontier:
            entry, i = heapq.heappop(frontier)
            if entry & _ORDER in by_order:
                return entry
            for c in (2 * i + 1, 2 * i + 2):
                if c < n:
                    heapq.heappush(frontier, (heap[c], c))
        return None

    def _compact(self) -> None:
        by_order = self._by_order
        for lane in self._lanes.values():
            for heap in lane.heaps:
                # A re-queued request's old entries carry its old order: dead.
                heap[:] = [e for e in heap if e & _ORDER in by_order]
                heapq.heapify(heap)
        self._dead = 0  # lanes are dropped as they empty: every one kept has live entries
