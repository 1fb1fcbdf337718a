"""A request's time limits: `maxRunTime` from the moment it may run, and the
caller's `X-Gpulane-Max-Wait` while it waits (a part of `Scheduler`,
app/runtime/scheduler.py). Each ends the request in the scheduler and tells
whoever serves it why."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.core import events as ev
from app.core.state import SchedulerState
from app.runtime.admission import WaitEstimates
from app.runtime.api import Detached, Ticket
from app.runtime.ports import Cancellable, Timers
from app.runtime.swaps import Swaps

log = logging.getLogger("gpulane.scheduler")


class TimeLimits:
    """maxRunTime and X-Gpulane-Max-Wait timers (mixed into `Scheduler`)."""

    state: SchedulerState
    clock: Callable[[], int]
    swaps: Swaps
    running_since: dict[str, int]
    _timers: Timers
    _deadlines: dict[str, Cancellable]
    _max_waits: dict[str, Cancellable]
    _waits: WaitEstimates

    if TYPE_CHECKING:

        def _end(self, event: ev.AnyEvent, detach: Detached | None = None) -> bool:
            raise NotImplementedError

    def _arm_max_wait(self, request_id: str, max_wait_ns: int | None, enqueued_ns: int) -> None:
        if max_wait_ns is None:
            return
        left = max(0, enqueued_ns + max_wait_ns - self.clock()) / 1e9
        self._max_waits[request_id] = self._timers.call_later(
            left, self._waited_too_long, request_id, max_wait_ns
        )

    def _waited_too_long(self, request_id: str, max_wait_ns: int) -> None:
        """The caller's X-Gpulane-Max-Wait passed while it still waits: cancelled
        (reason `deadline`), answered 503 with the wait it would still have."""
        self._max_waits.pop(request_id, None)
        queued = self.state.queue.get(request_id)
        if queued is None:
            return  # dispatched (or gone) in time
        left = self._waits.wait(self.state, queued, self.running_since, self.clock())
        message = (
            f"request {request_id} waited its X-Gpulane-Max-Wait ({max_wait_ns / 1e9:g} s) "
            f"in the queue without starting; estimated wait from now {left.text()}"
        )
        self._end(
            ev.RequestCancelled(at=self.clock(), request_id=request_id, reason="deadline"),
            Detached(503, "deadline_exceeded", message, retry_after=left.seconds),
        )

    def _hand_over(self, ticket: Ticket, url: str, model: str) -> None:
        """The request may run now: its sender gets `url`, and from here its
        model's `maxRunTime` bounds it (every run has a deadline where one is set)."""
        if not ticket.ready.done():
            ticket.ready.set_result(url)
        limit = self.swaps.spec(model).max_run_time
        rid = ticket.request_id
        if limit is None or rid in self._deadlines:
            return
        self._deadlines[rid] = self._timers.call_later(limit, self._overran, rid, limit)

    def _overran(self, request_id: str, limit: float) -> None:
        self._deadlines.pop(request_id, None)
        model = self.state.running.get(request_id)
        if model is None:
            return
        message = f"the request ran longer than maxRunTime ({limit:g} s) for model {model!r}"
        log.warning("request %s: %s; restarting the upstream", request_id, message)
        self.swaps.stop(model, "hung")
        self._end(
            ev.RequestFailed(
                at=self.clock(), request_id=request_id, error=message, http_status=504
            ),
            Detached(504, "upstream_timeout", message),
        )
