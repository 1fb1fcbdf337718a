"""The live queue view for the HTTP routes, without holding the run loop.

The view is computed on the event loop, from the scheduler's own state, so it
is exactly the queue as of one instant, in the order its estimated starts
simulate (app/report/live_queue.py). A page of the console
(a window of the first rows) costs about a millisecond at 10,000 waiting
(`ScoreQueue.lanes_in_order`). A view that walks much of the queue (`GET
/api/queue`, a user key's page, a deep window) would hold the loop for tens of
milliseconds, and every request the proxy serves would wait meanwhile: it is
computed instead on a snapshot of the state (`SchedulerState.snapshot`, under a
millisecond at 10,000), in slices of 128 rows, with the loop's other
work between them (`live_queue.queue_view_steps`). Not a thread: pure Python in
a thread would take the GIL from the loop for up to the interpreter's switch
interval (5 ms) at each of its wake-ups.
"""

from __future__ import annotations

import asyncio

from app.core.state import SchedulerState
from app.report.live_queue import QueueView, Steps, Times, queue_view_steps
from app.runtime.api import LiveState
from app.runtime.scheduler import Scheduler

AT_ONCE = 4
"""Slices computed at once, on the live state, before a view goes to a snapshot:
a first page of 100 needs one to three (its estimate follows the queue until
its last row has started), about a millisecond."""


async def live_queue_view(
    scheduler: Scheduler,
    times: Times | None = None,
    *,
    first: int = 0,
    count: int | None = None,
    caller: str | None = None,
) -> QueueView:
    """`live_queue.queue_view` of the scheduler's state as of now (same arguments;
    `times` by default the scheduler's own, those of `Retry-After`)."""
    if times is None:
        times = scheduler.durations()

    def steps(live: LiveState, state: SchedulerState) -> Steps[QueueView]:
        return queue_view_steps(
            state,
            live.running_since if state is live.state else dict(live.running_since),
            live.now_ns,
            times,
            first=first,
            count=count,
            caller=caller,
        )

    # A page of the console ends within its first few slices: then on the live
    # state, no copy (nothing else runs until it returns).
    live = scheduler.live()
    slices = steps(live, live.state)
    try:
        for _ in range(AT_ONCE):
            next(slices)
    except StopIteration as done:
        view: QueueView = done.value
        return view
    slices.close()
    await asyncio.sleep(0)
    live = scheduler.live()
    slices = steps(live, live.state.snapshot())
    while True:
        try:
            next(slices)
        except StopIteration as done:
            view = done.value
            return view
        await asyncio.sleep(0)  # the run loop's other work, then the next slice
