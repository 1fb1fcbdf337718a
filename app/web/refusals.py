"""Recording a request refused before it is queued, whichever door refused it.

Every door records its refusals the same way: a `request_rejected` event
(Scheduler.reject), whose id the answer carries as `X-Request-Id`, so "why was
my request refused?" is answered by `gpulane explain ID` and the history.
A refusal is recorded once a request reached its door: the key check, the
HTTP server's own limits (app/web/limits.py) and unknown routes answer before
that, with nothing recorded.
"""

from __future__ import annotations

from typing import NamedTuple

from app.jobs.errors import JobsError, NoSpace, OverCap, Unavailable
from app.runtime.api import Admission
from app.runtime.scheduler import Scheduler
from app.web.errors import jobs_status, request_id_header

Headers = list[tuple[bytes, bytes]]

_JOBS_REASONS: dict[type[JobsError], str] = {
    NoSpace: "disk_reserve",
    OverCap: "caller_storage_full",
}
"""A jobs-service refusal's `reason`, as `/metrics` counts it (None: invalid request)."""


class Asked(NamedTuple):
    """What is known of a refused request when it is refused."""

    endpoint: str
    model: str | None = None
    priority: int = 0
    caller: str | None = None


def asked_by(admission: Admission) -> Asked:
    return Asked(
        admission.endpoint, admission.model_requested, admission.priority, admission.caller
    )


def record(
    scheduler: Scheduler, asked: Asked, status: int, message: str, reason: str | None = None
) -> Headers:
    """Record a refusal: the headers that name its record."""
    return request_id_header(
        scheduler.reject(
            asked.endpoint,
            status,
            message,
            asked.model,
            asked.priority,
            asked.caller,
            reason=reason,
        )
    )


def record_jobs_error(scheduler: Scheduler, asked: Asked, exc: JobsError) -> Headers:
    """A jobs-service refusal, recorded unless the service did (`recorded_as`),
    or the log itself refused the write (`Unavailable`: no record could be)."""
    if exc.recorded_as is not None:
        return request_id_header(exc.recorded_as)
    if isinstance(exc, Unavailable):
        return []
    reason = _JOBS_REASONS.get(type(exc))
    return record(scheduler, asked, jobs_status(exc), exc.message, reason)
