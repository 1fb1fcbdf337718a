"""Admission control: a bounded queue, and how long a refused caller should wait.

`maxQueued` bounds the waiting requests of everyone, `maxQueuedPerCaller` (or a
key's own `maxQueued`) those of one caller. A request over a bound is refused
with 429 and a `Retry-After` of its estimated wait: what is left of the running
work plus the expected runs of the waiting requests that would go before it (at
its priority or above), from recorded run times. The estimate ignores aging and
swaps: it is a hint for a client's back-off, not a promise. It costs O(n), so
`WaitEstimates` keeps each priority's answer for a second: a client hammering a
full queue of 100,000 costs one pass a second, not one per refusal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from app.config import Config
from app.core.scoring import NS_PER_S
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


class WaitEstimates:
    """`estimated_wait_s`, remembered per priority for `TTL_NS`."""

    TTL_NS = NS_PER_S

    def __init__(self) -> None:
        self._known: dict[int, tuple[int, int]] = {}  # priority -> (computed at, seconds)

    def get(
        self,
        state: SchedulerState,
        priority: int,
        running_since: Mapping[str, int],
        now_ns: int,
    ) -> int:
        known = self._known.get(priority)
        if known is not None and 0 <= now_ns - known[0] < self.TTL_NS:
            return known[1]
        if len(self._known) > 1000:
            self._known.clear()  # priorities are few; a client trying many is not kept
        wait = estimated_wait_s(state, priority, running_since, now_ns)
        self._known[priority] = (now_ns, wait)
        return wait


def check_bounds(
    config: Config,
    state: SchedulerState,
    caller: str | None,
    priority: int,
    running_since: Mapping[str, int],
    now_ns: int,
    waits: WaitEstimates,
) -> None:
    """Raise Refused (429) when one more waiting request would pass a bound."""
    waiting = len(state.queue)
    if waiting >= config.max_queued:
        raise _full(
            f"the queue is full: {waiting} requests are waiting (maxQueued {config.max_queued})",
            "queue_full",
            waits.get(state, priority, running_since, now_ns),
        )
    limit = config.caller_queue_limit(caller)
    if limit is None:
        return
    mine = state.open_by_caller.get(caller, 0) - sum(
        1 for rid in state.running if state.requests[rid].caller == caller
    )
    if mine >= limit:
        who = f"caller {caller!r}" if caller else "the anonymous caller"
        raise _full(
            f"{who} has {mine} requests waiting, its limit (maxQueuedPerCaller or "
            f"the key's maxQueued) is {limit}",
            "caller_queue_full",
            waits.get(state, priority, running_since, now_ns),
        )


def _full(message: str, reason: str, wait: int) -> Refused:
    return Refused(
        f"{message}; retry after about {wait} s",
        status=429,
        code=reason,
        reason=reason,
        retry_after=wait,
    )


def estimated_wait_s(
    state: SchedulerState, priority: int, running_since: Mapping[str, int], now_ns: int
) -> int:
    """Whole seconds (at least 1) a request at `priority` would wait if it came
    now: O(n) over the waiting requests, paid only when refusing."""
    known = [q.expected_run_ns for q in state.queue if q.expected_run_ns is not None]
    known += [r.expected_run_ns for r in state.requests.values() if r.running and r.expected_run_ns]
    # A request without history counts as the median of those with one.
    typical = sorted(known)[(len(known) - 1) // 2] if known else 0
    total = 0
    for rid in state.running:
        request = state.requests[rid]
        expected = request.expected_run_ns if request.expected_run_ns is not None else typical
        total += max(0, expected - (now_ns - running_since.get(rid, now_ns)))
    for q in state.queue:
        if q.priority >= priority:
            total += q.expected_run_ns if q.expected_run_ns is not None else typical
    return max(1, math.ceil(total / NS_PER_S))
