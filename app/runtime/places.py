"""A waiting request's place in the live queue, computed only when asked.

"Place" means what the queue page, `/api/queue`, `gpulane queue` and explain
mean by position: the order the estimated starts simulate
(`start_estimate.start_steps`: the dispatch rule played forward), not the next
decision's score order alone. Finding it walks the queue down to that request,
O(k log k) for the k-th, so nothing on the request path asks for it: an
admission, a dispatch and a job's 202 never do. A job's view (`/v1/jobs/{id}`)
and a streaming request's loading chunks ask, and `Places` keeps what one walk
found for as long as the state does not change (`Scheduler.version`) and at most
`TTL_NS` (the simulation also moves with the clock): polls between two changes
cost a dictionary look-up, however deep the queue. A walk that goes far runs in
slices (`in_slices`), with the run loop's other work between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import TypeVar

from app.core.run_estimate import Durations
from app.core.start_estimate import start_steps
from app.runtime.api import LiveState

T = TypeVar("T")
Steps = Generator[None, None, T]
"""A computation in slices: yields between them, returns its result."""

AT_ONCE = 4
"""Slices computed at once, on the live state, before a computation goes to a
snapshot: the front of the queue (a few hundred rows) in about a millisecond."""

TTL_NS = 1_000_000_000
"""How long one walk's places are kept while the state does not change."""


async def in_slices(live: Callable[[], LiveState], steps: Callable[[LiveState], Steps[T]]) -> T:
    """Run `steps` on the live state, at once when it ends within `AT_ONCE` slices
    (nothing else runs until it returns); else again on a snapshot of the state
    (`SchedulerState.snapshot`, under a millisecond at 10,000) in slices, the run
    loop's other work between them. Not a thread: pure Python in a thread would
    take the GIL from the loop for up to the switch interval at each wake-up.
    `steps` must read only the `LiveState` it is given."""
    now = live()
    slices = steps(now)
    try:
        for _ in range(AT_ONCE):
            next(slices)
    except StopIteration as done:
        result: T = done.value
        return result
    slices.close()
    await asyncio.sleep(0)
    now = live()
    copy = LiveState(
        state=now.state.snapshot(), running_since=dict(now.running_since), now_ns=now.now_ns
    )
    slices = steps(copy)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            result = done.value
            return result
        await asyncio.sleep(0)  # the run loop's other work, then the next slice


class Places:
    """How many waiting requests go before a given one, in the live queue's order,
    kept per state version (see the module's docstring)."""

    def __init__(
        self,
        live: Callable[[], LiveState],
        version: Callable[[], int],
        durations: Callable[[], Durations],
    ) -> None:
        self._live = live
        self._version = version
        self._durations = durations
        self._seen: tuple[int, int] = (-1, 0)
        """(state version, clock ns) of the walk `_ahead` holds."""
        self._ahead: dict[str, int] = {}
        """Request id -> requests before it, for the first ones the walk placed."""

    async def ahead(self, request_id: str) -> int | None:
        """Requests that go before `request_id` (0: it goes next); None when it
        does not wait."""
        live = self._live()
        if request_id not in live.state.queue:
            return None
        version = self._version()
        if self._seen[0] != version or live.now_ns - self._seen[1] >= TTL_NS:
            self._seen, self._ahead = (version, live.now_ns), {}
        found = self._ahead.get(request_id)
        if found is not None:
            return found
        durations = self._durations()

        def walk(now: LiveState) -> Steps[dict[str, int]]:
            return start_steps(
                now.state, now.running_since, now.now_ns, durations, wanted=(request_id,)
            )

        starts = await in_slices(self._live, walk)
        placed = {rid: i for i, rid in enumerate(starts)}
        if self._seen[0] == version:
            # A deeper walk of the same state: it places every request the last one did.
            self._ahead = placed
        return placed.get(request_id)
