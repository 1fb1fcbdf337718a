"""A request's wait, and its time to start: one definition each for every reader.

The wait runs from the request's arrival (its first enqueue: a durable job's
later attempts keep it) to the dispatch of its last attempt; a request whose
last attempt was never dispatched (cancelled, timed out, failed or abandoned
while queued) waited until its end. While it is still queued, its wait so far
runs to now. Its own swap, if it caused one, comes after its dispatch: that is
`swap`, not wait.

History and the SQL views read `requests.queue_wait_ms`, which the read model
writes by the same rule (app/store/read_model.py); explain, the live queue, the
metrics, the `X-Gpulane-Queue-Wait-Ms` header and tools/replay call `wait_ns`.

Its time to start is what a person waiting for it feels: from its arrival to
its `request_started` (sent to its upstream), so the wait and, after its
dispatch, its own load (a swap) are both in it. A request never started has
none. The `X-Gpulane-Time-To-Start-Ms` header and explain (the console's
request page) call `time_to_start_ns`.
"""

from __future__ import annotations


def wait_ns(arrived_ns: int, dispatched_ns: int | None, until_ns: int) -> int:
    """The wait of a request that arrived at `arrived_ns` and whose last attempt
    was dispatched at `dispatched_ns` (None: never); `until_ns` is its end, or
    now while it is open (a queued request's wait so far)."""
    return (dispatched_ns if dispatched_ns is not None else until_ns) - arrived_ns


def time_to_start_ns(arrived_ns: int, started_ns: int) -> int:
    """From the arrival of a request (its first enqueue) to the start of its
    last attempt at `started_ns` (`request_started`): its wait, then its own
    load. A request not started has no time to start."""
    return started_ns - arrived_ns
