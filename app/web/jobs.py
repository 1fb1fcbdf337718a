"""The `Prefer: respond-async` door and `/v1/jobs`: HTTP onto the jobs service.

A request sent with `Prefer: respond-async` is handed to the service
(app/jobs/durable.py) as a `JobRequest`, and answered `202 Accepted` with the
job's view once its body and enqueue are on disk (`Location: /v1/jobs/{id}`);
a refusal is answered by app/web/errors.py. The job runs upstream through the
proxy's Forwarder (`ForwardedJobs`).

A user key sees, fetches and cancels only its own jobs (app/web/access.py); an
idempotency key belongs to the caller that sent it.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, delete, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from litestar.types import Message, Send
from sqlalchemy import Engine

from app.config import Config
from app.jobs.durable import Accepted, JobRequest, Jobs, KeepResult
from app.jobs.errors import JobsError
from app.runtime.admission import Refused
from app.runtime.api import Admission, Ticket
from app.runtime.scheduler import Scheduler
from app.web.access import identity, only_caller
from app.web.errors import error_response, jobs_error, send_jobs_error, send_json, send_refused
from app.web.forward import HOP_BY_HOP, Forwarder, Reply, priority_headers, upstream_url
from app.web.refusals import asked_by, record_jobs_error
from app.web.responses import DOOR, response_object

JOB_STATUSES = ("queued", "running", "completed", "failed", "cancelled", "abandoned")


class ForwardedJobs:
    """The service's `Upstream`: a dispatched job sent through the Forwarder,
    its answer captured whole instead of streamed to a client."""

    connection_headers = HOP_BY_HOP

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder

    async def send(
        self, ticket: Ticket, base_url: str, job: dict[str, Any], body: bytes, keep: KeepResult
    ) -> None:
        captured = _Captured()

        async def keep_result() -> None:
            await keep(captured.status, captured.headers, bytes(captured.body))

        await self.forwarder.forward(
            job["method"],
            upstream_url(base_url, job["path"], job["query"]),
            body,
            dict(job["headers"]),
            ticket,
            Reply(captured.send, ticket),
            before_completed=keep_result,
        )


class JobRunner(Jobs):
    """The jobs service running its jobs through the proxy's Forwarder."""

    def __init__(
        self, config: Config, scheduler: Scheduler, forwarder: Forwarder, engine: Engine
    ) -> None:
        super().__init__(config, scheduler, engine, ForwardedJobs(forwarder))


class JobDoor:
    """Answers the requests the proxy hands over (`Prefer: respond-async`, and
    the Responses API's `background: true`) with the service's job."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs

    async def accept(self, send: Send, admission: Admission, request: JobRequest) -> None:
        accepted = await accept_or_answer(self.jobs, send, admission, request)
        if accepted is not None:
            await _send_accepted(send, accepted, request.door, admission)


async def accept_or_answer(
    jobs: Jobs, send: Send, admission: Admission, request: JobRequest
) -> Accepted | None:
    """Hand `request` to the jobs service: its acceptance, or None once a refusal
    or the service's error is answered on `send` (every door answers them alike),
    recorded as a `request_rejected` (app/web/refusals.py)."""
    try:
        return await jobs.accept(admission, request)
    except Refused as exc:
        await send_refused(send, exc)  # recorded by the service
    except JobsError as exc:
        headers = record_jobs_error(jobs.scheduler, asked_by(admission), exc)
        await send_jobs_error(send, exc, headers)
    return None


async def _send_accepted(
    send: Send, accepted: Accepted, door: str | None, admission: Admission
) -> None:
    """202 with the job's view (200 with a Response object for `background`);
    a job an Idempotency-Key found again is 200, without the priority headers."""
    view = accepted.view
    doc = response_object(view) if door == DOOR else view
    status = 202 if accepted.fresh and door != DOOR else 200
    headers = [
        (b"location", f"/v1/jobs/{accepted.request_id}".encode()),
        (b"x-request-id", accepted.request_id.encode()),
    ]
    if accepted.fresh:
        headers += priority_headers(
            admission.priority, admission.requested_priority, admission.priority_unreadable
        )
    await send_json(send, status, msgspec.json.encode(doc), headers)


class _Captured:
    """An ASGI `send` that keeps the response instead of sending it."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
            ]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


def job_routes(jobs: Jobs) -> list[BaseRouteHandler]:
    @get("/v1/jobs")
    async def list_jobs(
        request: Request[Any, Any, Any],
        status: FromQuery[str | None] = None,
        limit: FromQuery[int] = 50,
    ) -> Response[Any]:
        if status is not None and status not in JOB_STATUSES:
            message = f"status {status!r} is not one of {', '.join(JOB_STATUSES)}"
            return error_response(400, message, "invalid_status", param="status")
        caller = only_caller(identity(request.scope))
        data = await jobs.listing(status, max(1, min(limit, 1000)), caller)
        return Response({"object": "list", "data": data})

    @get("/v1/jobs/{job_id:str}")
    async def get_job(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        view = await jobs.view_for(only_caller(identity(request.scope)), job_id)
        if view is None:
            return error_response(404, f"no job {job_id}", "job_not_found")
        return Response(view)

    @get("/v1/jobs/{job_id:str}/result")
    async def get_result(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        try:
            status, headers, body = await jobs.result(only_caller(identity(request.scope)), job_id)
        except JobsError as exc:
            return jobs_error(exc)
        keep = {k: v for k, v in headers if k.lower() in ("content-type", "content-encoding")}
        return Response(body, status_code=status, headers=keep, media_type=keep.get("content-type"))

    @delete("/v1/jobs/{job_id:str}", status_code=200)
    async def cancel_job(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        try:
            return Response(await jobs.cancel(only_caller(identity(request.scope)), job_id))
        except JobsError as exc:
            return jobs_error(exc)

    return [list_jobs, get_job, get_result, cancel_job]
