"""What a stop does to each open request: pure answers the run loop asks when
it drains (`Scheduler.drain`) or an operator unloads a model
(`Scheduler.unload`), so every stop treats requests by one rule.

At a graceful stop, a waiting synchronous request is cancelled (its client
gets 503); a waiting durable job stays queued in the log for the next start.
What still runs when the grace period ends, or on a model an operator unloads:
a durable job goes back in the queue on the same attempt (a stop is not the
job's fault), a synchronous request fails. An unload leaves the waiting
requests queued: their model loads again when their turn comes.
"""

from __future__ import annotations

from typing import Literal

from app.core.state import SchedulerState

Fate = Literal["requeue", "fail"]


def cancelled_at_stop(state: SchedulerState) -> list[str]:
    """The requests a drain cancels at once: waiting and not durable, in the
    order they opened."""
    return [rid for rid, r in state.requests.items() if not r.running and not r.durable]


def after_grace(state: SchedulerState, model: str | None = None) -> list[tuple[str, Fate]]:
    """What becomes of each request still running (on `model`, None: on any)
    when the grace period ends or its model is unloaded, in dispatch order."""
    return [
        (rid, "requeue" if state.requests[rid].durable else "fail")
        for rid, on in state.running.items()
        if model is None or on == model
    ]
