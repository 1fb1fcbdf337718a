"""The live queue view for the HTTP routes, without holding the run loop.

The view is computed on the event loop, from the scheduler's own state, so it
is exactly the queue as of one instant, in the order its estimated starts
simulate (app/report/live_queue.py). A page of the console
(a window of the first rows) costs about a millisecond at 10,000 waiting
(`ScoreQueue.lanes_in_order`). A view that walks much of the queue (a deep
window of `GET /api/queue`, a user key's page) would hold the loop for tens of
milliseconds, and every request the proxy serves would wait meanwhile: it is
computed instead on a snapshot of the state in slices of 128 rows, with the
loop's other work between them (`places.in_slices`, `live_queue.queue_view_steps`).
"""

from __future__ import annotations

from app.report.live_queue import QueueView, Steps, Times, queue_view_steps
from app.runtime.api import LiveState
from app.runtime.places import in_slices
from app.runtime.scheduler import Scheduler


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
    known = scheduler.durations() if times is None else times

    def steps(live: LiveState) -> Steps[QueueView]:
        return queue_view_steps(
            live.state,
            live.running_since,
            live.now_ns,
            known,
            first=first,
            count=count,
            caller=caller,
        )

    return await in_slices(scheduler.live, steps)
