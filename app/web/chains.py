"""`GET /api/chains` and `GET /api/chains/{id}`: chains (`X-Gpulane-Chain`) with
their progress (app/jobs/chain_progress.py), and one chain's shots (`offset`,
`limit`: 200, at most 1000). A user key sees only its own
chains, another caller's is 404 as if unknown; an admin sees every caller's
and names the caller (`?caller=`) when several callers use the same id."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery

from app.jobs.chain_progress import ChainProgress
from app.jobs.errors import JobsError
from app.web.access import identity, only_caller
from app.web.errors import jobs_error


def chain_routes(chains: ChainProgress) -> list[BaseRouteHandler]:
    @get("/api/chains")
    async def listing(request: Request[Any, Any, Any], limit: FromQuery[int] = 50) -> Response[Any]:
        viewer = only_caller(identity(request.scope))
        data = await chains.listing(viewer, max(1, min(limit, 200)))
        return Response({"object": "list", "data": data})

    @get("/api/chains/{chain_id:str}")
    async def retrieve(
        request: Request[Any, Any, Any],
        chain_id: FromPath[str],
        caller: FromQuery[str | None] = None,
        offset: FromQuery[int] = 0,
        limit: FromQuery[int] = 200,
    ) -> Response[Any]:
        viewer = only_caller(identity(request.scope))
        page = (max(0, offset), max(1, min(limit, 1000)))
        try:
            return Response(await chains.chain(viewer, chain_id, caller, *page))
        except JobsError as exc:
            return jobs_error(exc)

    return [listing, retrieve]
