"""`/ui/api/batches/{id}/lines`: a page of a batch's lines, for the console's batch page."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery

from app.jobs.batches import Batches
from app.jobs.errors import JobsError
from app.web.access import identity, only_caller
from app.web.console.security import SECURITY_HEADERS
from app.web.errors import jobs_error


def batch_line_routes(batches: Batches) -> list[BaseRouteHandler]:
    @get("/ui/api/batches/{batch_id:str}/lines", response_headers=SECURITY_HEADERS)
    async def lines(
        request: Request[Any, Any, Any],
        batch_id: FromPath[str],
        offset: FromQuery[int] = 0,
        limit: FromQuery[int] = 200,
    ) -> Response[Any]:
        """A page of the batch's lines with their jobs' status (another caller's batch: 404)."""
        offset, limit = max(0, min(offset, 2**62)), max(1, min(limit, 1000))
        try:
            data, total = await batches.lines(
                only_caller(identity(request.scope)), batch_id, offset, limit
            )
        except JobsError as exc:
            return jobs_error(exc)
        return Response({"data": data, "offset": offset, "total": total})

    return [lines]
