"""What a graceful stop does to each open request: pure answers the run loop
asks when it drains (`Scheduler.drain`), so a stop treats every request by one
rule the tests read here.

At the stop, a waiting synchronous request is cancelled (its client gets 503);
a waiting durable job stays queued in the log for the next start. After the
grace period, what still runs: a durable job goes back in the queue on the
same attempt (a stop is not the job's fault), a synchronous request fails.
"""

from __future__ import annotations

from typing import Literal

from app.core.state import SchedulerState

Fate = Literal["requeue", "fail"]


def cancelled_at_stop(state: SchedulerState) -> list[str]:
    """The requests a drain cancels at once: waiting and not durable, in the
    order they opened."""
    return [rid for rid, r in state.requests.items() if not r.running and not r.durable]


def after_grace(state: SchedulerState) -> list[tuple[str, Fate]]:
    """What becomes of each request still running when the grace period ends,
    in the order they were dispatched."""
    return [(rid, "requeue" if state.requests[rid].durable else "fail") for rid in state.running]
