"""`DELETE /api/requests/{id}`: an operator's way to free the lane.

Cancels a request whether it waits or runs; a running one is cut off at once
(its upstream connection is closed) even when the upstream does not answer.
Recorded as `request_cancelled` with reason `explicit`. A user key cancels only
its own requests: another caller's answers the same 404 as a request not open.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath

from app.runtime.scheduler import Scheduler
from app.web.access import identity, may_see
from app.web.errors import error_body


def admin_routes(scheduler: Scheduler) -> list[BaseRouteHandler]:
    @delete("/api/requests/{request_id:str}", status_code=200, sync_to_thread=False)
    def cancel_request(request: Request[Any, Any, Any], request_id: FromPath[str]) -> Response[Any]:
        open_request = scheduler.live().state.requests.get(request_id)
        mine = open_request is not None and may_see(identity(request.scope), open_request.caller)
        was = scheduler.cancel_any(request_id) if mine else None
        if was is None:
            message = f"request {request_id} is not queued or running"
            return Response(
                error_body(404, message, "request_not_open"),
                status_code=404,
                media_type="application/json",
            )
        return Response({"id": request_id, "cancelled": True, "was": was})

    return [cancel_request]
