"""A request's wait: one definition for every reader.

The wait runs from the request's arrival (its first enqueue: a durable job's
later attempts keep it) to the dispatch of its last attempt; a request whose
last attempt was never dispatched (cancelled, timed out, failed or abandoned
while queued) waited until its end. While it is still queued, its wait so far
runs to now. Its own swap, if it caused one, comes after its dispatch: that is
`swap`, not wait.

History and the SQL views read `requests.queue_wait_ms`, which the read model
writes by the same rule (app/store/read_model.py); explain, the live queue, the
metrics, the `X-Gpulane-Queue-Wait-Ms` header and tools/replay call `wait_ns`.
"""

from __future__ import annotations


def wait_ns(arrived_ns: int, dispatched_ns: int | None, until_ns: int) -> int:
    """The wait of a request that arrived at `arrived_ns` and whose last attempt
    was dispatched at `dispatched_ns` (None: never); `until_ns` is its end, or
    now while it is open (a queued request's wait so far)."""
    return (dispatched_ns if dispatched_ns is not None else until_ns) - arrived_ns
