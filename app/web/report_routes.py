"""`GET /api/queue` and `GET /api/requests/{id}/explain` (see app/report/).

A user key sees only its own rows of the queue (positions stay those of the
whole queue, so "position 5" still means four requests go first) and only its
own requests' stories, where other callers' work is "another caller's request"
(app/report/visibility.py); another caller's request is 404, as if unknown.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgspec
from litestar import Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from sqlalchemy import Engine

from app.report.explain import explain, live_position
from app.report.live_queue import position_of
from app.report.run_times import CachedRunTimes
from app.report.visibility import queue_seen_by, story_seen_by
from app.runtime.scheduler import Scheduler
from app.web.access import identity, may_see, only_caller
from app.web.errors import error_body
from app.web.live_queue_view import live_queue_view

PAGE = 100
"""Waiting rows of `GET /api/queue` when no `limit` is given."""
MAX_PAGE = 1000
"""The most waiting rows one page of `GET /api/queue` lists."""


class Runs(Protocol):
    """The batches' progress (app/jobs/batch_progress.py), the chains'
    (app/jobs/chain_progress.py)."""

    async def runs(self, caller: str | None) -> list[dict[str, Any]]: ...

    async def run_of(self, request_id: str) -> dict[str, Any] | None: ...


def report_routes(
    scheduler: Scheduler,
    engine: Engine | None,
    runs: Runs | None = None,
    chains: Runs | None = None,
) -> list[BaseRouteHandler]:
    """The handlers; scheduler state is read on the event loop, the database in
    threads. `runs` gives the open batches with their progress and ETA, `chains`
    the open chains: listed in `/api/queue` as `runs`, and a line's explanation
    carries its `batch`, a shot's its `chain` (with its place, `shot`)."""
    run_times = CachedRunTimes(engine)

    @get("/api/queue")
    async def live_queue(
        request: Request[Any, Any, Any],
        offset: FromQuery[int] = 0,
        limit: FromQuery[int] = PAGE,
    ) -> Response[Any]:
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            return _error(
                400,
                f"offset must be 0 or more and limit 1 to {MAX_PAGE}; got offset "
                f"{offset} and limit {limit}",
                "invalid_page",
                "offset" if offset < 0 else "limit",
            )
        caller = only_caller(identity(request.scope))
        # A page of waiting rows, whole-queue positions offset+1 .. offset+limit; a
        # user key's page is the offset-th to (offset+limit)-th of its own rows.
        # The view walks only as far as the page (in slices: the loop moves on).
        if caller is None:
            view = await live_queue_view(scheduler, first=offset, count=limit)
        else:
            view = await live_queue_view(scheduler, caller=caller)
            view = queue_seen_by(view, caller)
            view = msgspec.structs.replace(view, waiting=view.waiting[offset : offset + limit])
        doc = msgspec.to_builtins(view)
        doc["offset"], doc["limit"] = offset, limit
        doc["runs"] = [] if runs is None else await runs.runs(caller)
        if chains is not None:
            doc["runs"] += await chains.runs(caller)
        return Response(doc)

    @get("/api/requests/{request_id:str}/explain")
    async def explain_request(
        request: Request[Any, Any, Any], request_id: FromPath[str]
    ) -> Response[Any]:
        if engine is None:
            return _error(503, "this server has no event log to explain from", "no_database")
        times = await asyncio.to_thread(run_times.get)
        # Everything else the story needs (fifo settings included) is in the log.
        story = await asyncio.to_thread(
            explain, engine, request_id, now_ns=scheduler.clock(), run_times=times
        )
        who = identity(request.scope)
        if story is None or not may_see(who, story.caller):
            return _error(404, f"no request {request_id!r}", "request_not_found")
        story = story_seen_by(story, only_caller(who))
        # The log may trail the run loop by a group commit: position from the live state.
        live = scheduler.live()
        durations = scheduler.durations()  # Retry-After's and the live queue's
        found = position_of(live.state, live.running_since, live.now_ns, durations, request_id)
        if found is not None:
            story = msgspec.structs.replace(story, waiting=live_position(found, live.now_ns))
        doc = msgspec.to_builtins(story)
        run = None if runs is None else await runs.run_of(request_id)
        if run is not None:
            doc["batch"] = run
        chain = None if chains is None else await chains.run_of(request_id)
        if chain is not None:
            doc["chain"] = (doc.get("chain") or {}) | chain  # its place, and the chain's progress
        return Response(doc)

    return [live_queue, explain_request]


def _error(status: int, message: str, code: str, param: str | None = None) -> Response[Any]:
    return Response(
        error_body(status, message, code, param=param),
        status_code=status,
        media_type="application/json",
    )
