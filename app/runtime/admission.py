"""Admission control: a bounded queue, and how long a refused caller should wait.

`maxQueued` bounds the waiting requests of everyone, `maxQueuedPerCaller` (or a
key's own `maxQueued`) those of one caller. A request over a bound is refused
with 429 and a `Retry-After` of its estimated wait (`estimated_wait_s`): when it
would start if it were queued now and nothing else came, by the one estimator of
the live queue (app/core/start_estimate.py: running work divided among each
model's slots, lanes side by side, each model's learnt run and load times),
rounded up. It is a hint for a client's back-off, not a promise. When work
ahead has run longer than every run of its model (its end is open), the wait is
what is known to be left, and the message says it is at least that. It costs O(n),
so `WaitEstimates` keeps each answer for a second: a client hammering a full
queue of 100,000 costs one pass a second, not one per refusal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from app.config import Config
from app.core.queue import Queued
from app.core.run_estimate import Durations
from app.core.scoring import NS_PER_S
from app.core.start_estimate import start_of
from app.core.state import SchedulerState


class Refused(Exception):
    """Admission refused: answer `status` with this code (OpenAI error shape);
    `reason` is what the rejection is counted as (default: the code),
    `retry_after` seconds a hint."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 503,
        code: str = "event_log_unavailable",
        reason: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.reason = reason or code
        self.retry_after = retry_after
        self.recorded_as: str | None = None
        """The id of its `request_rejected` once recorded (Scheduler.refused)."""


class Wait(NamedTuple):
    """An estimated wait: whole seconds, rounded up, at least 1."""

    seconds: int
    open: bool = False
    """Only the work known to be left: work ahead has run longer than every run
    of its model, so no later bound is known."""

    def text(self) -> str:
        """`about 17 s`, or `at least 17 s (...)` when `open`."""
        if not self.open:
            return f"about {self.seconds} s"
        return (
            f"at least {self.seconds} s (the work known to be left: work ahead has run "
            "longer than any run of its model, its end unknown)"
        )


class WaitEstimates:
    """`estimated_wait_s`, remembered per (priority, model, caller) for `TTL_NS`.
    `durations`: each model's run and load times as learnt now (the scheduler's)."""

    TTL_NS = NS_PER_S

    def __init__(self, durations: Callable[[], Durations] = Durations) -> None:
        self._known: dict[tuple[int, str, str | None], tuple[int, Wait]] = {}
        """(priority, model, caller) -> (computed at, the wait)."""
        self._durations = durations

    def get(
        self,
        state: SchedulerState,
        arriving: Queued,
        running_since: Mapping[str, int],
        now_ns: int,
    ) -> int:
        """`wait`'s seconds."""
        return self.wait(state, arriving, running_since, now_ns).seconds

    def wait(
        self,
        state: SchedulerState,
        arriving: Queued,
        running_since: Mapping[str, int],
        now_ns: int,
    ) -> Wait:
        # The caller matters only through the fair-share term.
        caller = arriving.caller if state.queue.params.fair_share_bonus else None
        key = (arriving.priority, arriving.model, caller)
        known = self._known.get(key)
        if known is not None and 0 <= now_ns - known[0] < self.TTL_NS:
            return known[1]
        if len(self._known) > 1000:
            self._known.clear()  # keys are few; a client trying many is not kept
        wait = estimated_wait(state, arriving, running_since, now_ns, self._durations())
        self._known[key] = (now_ns, wait)
        return wait


class BatchLines:
    """The open jobs that are lines of a Batch API batch, per caller: the
    per-caller bound neither applies to them nor counts them (docs/jobs.md,
    The Batch API). Ended lines are dropped when their caller is next counted."""

    def __init__(self) -> None:
        self._by_caller: dict[str | None, set[str]] = {}

    def add(self, caller: str | None, request_id: str) -> None:
        self._by_caller.setdefault(caller, set()).add(request_id)

    def waiting(self, caller: str | None, state: SchedulerState) -> int:
        """How many of `caller`'s batch lines wait in the queue: one set
        intersection over its open lines, in C (0.9 ms at 10,000 on a busy 2-vCPU VM)."""
        lines = self._by_caller.get(caller)
        if not lines:
            return 0
        lines.intersection_update(state.requests)
        if not lines:
            del self._by_caller[caller]
            return 0
        return len(lines) - sum(1 for rid in state.running if rid in lines)


def check_bounds(
    config: Config,
    state: SchedulerState,
    arriving: Queued,
    running_since: Mapping[str, int],
    now_ns: int,
    waits: WaitEstimates,
    batch_lines: BatchLines | None = None,
    *,
    batch_line: bool = False,
) -> None:
    """Raise Refused (429) when one more waiting request would pass a bound.
    A batch's line (`batch_line`) is held to `maxQueued` only; the caller's
    waiting batch lines (`batch_lines`) do not count against its own bound."""
    waiting = len(state.queue)
    if waiting >= config.max_queued:
        raise _full(
            f"the queue is full: {waiting} requests are waiting (maxQueued {config.max_queued})",
            "queue_full",
            waits.wait(state, arriving, running_since, now_ns),
        )
    if batch_line:
        return
    caller = arriving.caller
    limit = config.caller_queue_limit(caller)
    if limit is None:
        return
    mine = state.open_by_caller.get(caller, 0) - sum(
        1 for rid in state.running if state.requests[rid].caller == caller
    )
    if batch_lines is not None:
        mine -= batch_lines.waiting(caller, state)
    if mine >= limit:
        who = f"caller {caller!r}" if caller else "the anonymous caller"
        raise _full(
            f"{who} has {mine} requests waiting, its limit (maxQueuedPerCaller or "
            f"the key's maxQueued) is {limit}",
            "caller_queue_full",
            waits.wait(state, arriving, running_since, now_ns),
        )


def _full(message: str, reason: str, wait: Wait) -> Refused:
    return Refused(
        f"{message}; retry after {wait.text()}",
        status=429,
        code=reason,
        reason=reason,
        retry_after=wait.seconds,
    )


def estimated_wait(
    state: SchedulerState,
    arriving: Queued,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations | None = None,
) -> Wait:
    """Whole seconds, rounded up (at least 1), before `arriving` (not queued yet:
    `SchedulerState.newcomer`) would start if nothing else came: the live queue's own estimate
    (`start_estimate.start_of`) with `arriving` placed in the queue's order,
    after every equal score; `open` when that is only the work known to be left.
    O(n) over the waiting requests, paid only when refusing."""
    start = start_of(state, arriving, running_since, now_ns, times or Durations())
    return Wait(max(1, math.ceil((start.at_ns - now_ns) / NS_PER_S)), start.open)


def estimated_wait_s(
    state: SchedulerState,
    arriving: Queued,
    running_since: Mapping[str, int],
    now_ns: int,
    times: Durations | None = None,
) -> int:
    """`estimated_wait`'s seconds."""
    return estimated_wait(state, arriving, running_since, now_ns, times).seconds
