"""`gpulane ui --db FILE`: the console over a database copied from another machine.

The file is opened read-only (`open_readonly`: a self-contained copy as
`immutable`, so nothing is written beside it); there is no scheduler, so the
queue and the actions are absent and every page is drawn from the log. The
story page's `/api/requests/{id}/explain` is answered here as of the log's end,
the way `gpulane explain` tells it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from sqlalchemy import Engine

from app.report.explain import explain
from app.store.engine import DatabaseError, open_readonly, shown
from app.web.console import console_routes
from app.web.console.security import SECURITY_HEADERS, add_security_headers
from app.web.errors import EXCEPTION_HANDLERS, error_body
from app.web.sites import SiteRules, guard_sites


def explain_route(engine: Engine) -> BaseRouteHandler:
    @get("/api/requests/{request_id:str}/explain", response_headers=SECURITY_HEADERS)
    async def explain_request(
        request: Request[Any, Any, Any], request_id: FromPath[str]
    ) -> Response[Any]:
        story = await asyncio.to_thread(explain, engine, request_id)
        if story is None:
            body = error_body(404, f"no request {request_id!r}", "request_not_found")
            return Response(body, status_code=404, media_type="application/json")
        return Response(story)

    return explain_request


def readonly_app(engine: Engine) -> Litestar:
    return Litestar(
        route_handlers=[*console_routes(engine, None), explain_route(engine)],
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[add_security_headers],
        logging_config=None,
        debug=False,
    )


def ui_command(db: str, host: str, port: int) -> int:
    try:
        engine = open_readonly(db)
    except DatabaseError as exc:
        print(f"gpulane: {exc}", file=sys.stderr)
        return 1
    print(f"gpulane ui: http://{host}:{port}/ui/ (read-only, {shown(db)})", flush=True)
    # DNS rebinding would let any page read the log through the browser: the
    # Host check of `gpulane serve` (app/web/sites.py), with no config lists.
    app = guard_sites(readonly_app(engine), SiteRules(None, host))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    return 0
