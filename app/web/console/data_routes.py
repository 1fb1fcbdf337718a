"""The JSON the console's pages fetch, under `/ui/api/`.

Each route calls a reader that already exists (the live queue view, the run
times, the scheduler's model status, the log buffer) or one of the bounded
queries in app/store/console_queries.py. Actions are not here: the pages call
the existing admin routes (`DELETE /api/requests/{id}`, `POST /api/models/unload/{model}`).

`live` is None for `gpulane ui --db FILE`: the routes then read the database
only, and the time window defaults to the end of the log instead of now.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from litestar import MediaType, Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from sqlalchemy import Engine

from app import __version__
from app.config import Config
from app.report.run_times import CachedRunTimes
from app.report.visibility import event_data_seen_by, request_ids_in, swaps_seen_by
from app.runtime.gpu import MemoryStatus
from app.runtime.log_buffer import LogBuffer
from app.runtime.scheduler import Scheduler
from app.store import console_queries as q
from app.web.access import identity, is_admin, may_see, only_caller
from app.web.console.queue_page import page_window, queue_page
from app.web.console.security import SECURITY_HEADERS
from app.web.console.wait_percentiles import BANDS, wait_percentiles
from app.web.errors import error_body
from app.web.live_queue_view import live_queue_view

MAX_PAGE = 500
"""Waiting or history rows per page: the browser draws a window, never 10,000 rows."""
MAX_BARS = 5000
"""Timeline bars per window; a wider window says it was truncated."""
OUTPUT_LINES = 40
FINISHED_STATUSES = ("completed", "failed", "cancelled", "abandoned", "rejected")


@dataclass(frozen=True)
class Live:
    """What only a running `gpulane serve` has."""

    config: Config
    scheduler: Scheduler
    logs: LogBuffer


class BadQuery(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def data_routes(engine: Engine | None, live: Live | None) -> list[BaseRouteHandler]:
    run_times = CachedRunTimes(engine)

    def window(
        since: float | None,
        until: float | None,
        hours: float,
        whole: bool = False,
        fit: bool = False,
    ) -> tuple[float, float]:
        """[since, until] in unix seconds: the last `hours` before now (or before the
        log's end, for a copied log), or with `whole` the log's whole span, or with
        `fit` the last `hours` cut to start no earlier than the log does (so a
        fresh server's minutes fill the chart)."""
        wants_span = whole or fit or live is None
        span = q.log_span(engine) if wants_span and engine is not None else None
        if until is None:
            until = span[1] if span is not None and (whole or live is None) else time.time()
        if since is None:
            since = span[0] if whole and span is not None else until - hours * 3600.0
            if fit and span is not None:
                since = min(until, max(since, span[0]))
        if since > until:
            raise BadQuery(f"since ({since}) is after until ({until})")
        return since, until

    @get("/ui/api/info", sync_to_thread=False, response_headers=SECURITY_HEADERS)
    def info(request: Request[Any, Any, Any]) -> dict[str, Any]:
        who = identity(request.scope)
        return {
            "version": __version__,
            "live": live is not None,
            "database": None if engine is None else engine.url.database,
            "admin": is_admin(who),
            "caller": who.caller,
        }

    @get("/ui/api/queue", response_headers=SECURITY_HEADERS)
    async def queue(
        request: Request[Any, Any, Any], offset: FromQuery[int] = 0, limit: FromQuery[int] = 100
    ) -> Response[Any]:
        if live is None:
            return _json({"live": False})
        offset, limit = max(0, offset), max(1, min(limit, MAX_PAGE))
        caller = only_caller(identity(request.scope))
        # An admin's page is a window (O(page log page)); a user's lists only its
        # own rows (and the one ahead of each). A view that walks far is computed
        # in slices, the run loop's work between them (app/web/live_queue_view.py).
        first, count = page_window(offset, limit) if caller is None else (0, None)
        view = await live_queue_view(live.scheduler, first=first, count=count, caller=caller)
        return _json(queue_page(view, offset, limit, caller))

    @get("/ui/api/timeline", response_headers=SECURITY_HEADERS)
    async def timeline(
        request: Request[Any, Any, Any],
        since: FromQuery[float | None] = None,
        until: FromQuery[float | None] = None,
        hours: FromQuery[float] = 1.0,
        whole: FromQuery[bool] = False,
        fit: FromQuery[bool] = False,
    ) -> Response[Any]:
        if engine is None:
            return _error(503, "this server has no event log", "no_database")
        try:
            lo, hi = window(since, until, hours, whole, fit)
        except BadQuery as exc:
            return _error(400, exc.message, "invalid_window", "since")
        caller = only_caller(identity(request.scope))
        bars = await asyncio.to_thread(q.timeline_requests, engine, lo, hi, caller, MAX_BARS + 1)
        loads = await asyncio.to_thread(q.timeline_swaps, engine, lo, hi, MAX_BARS)
        loads = swaps_seen_by(loads, caller)  # others' swaps: no request id, no caller
        held = await asyncio.to_thread(q.timeline_footprints, engine, lo, hi, MAX_BARS)
        now = time.time() if live is not None else hi
        return _json(
            {
                "since": lo,
                "until": hi,
                "now": now,
                "requests": bars[:MAX_BARS],
                "swaps": loads,
                "footprints": held,
                "truncated": len(bars) > MAX_BARS,
            }
        )

    @get("/ui/api/history", response_headers=SECURITY_HEADERS)
    async def history(
        request: Request[Any, Any, Any],
        model: FromQuery[str | None] = None,
        band: FromQuery[str | None] = None,
        caller: FromQuery[str | None] = None,
        status: FromQuery[str | None] = None,
        since: FromQuery[float | None] = None,
        until: FromQuery[float | None] = None,
        hours: FromQuery[float] = 24.0,
        limit: FromQuery[int] = 50,
        offset: FromQuery[int] = 0,
    ) -> Response[Any]:
        if engine is None:
            return _error(503, "this server has no event log", "no_database")
        if band is not None and band not in BANDS:
            message = f"band {band!r} is not one of {', '.join(BANDS)}"
            return _error(400, message, "invalid_band", "band")
        if status is not None and status not in FINISHED_STATUSES:
            allowed = ", ".join(FINISHED_STATUSES)
            message = f"status {status!r} is not one of {allowed}"
            return _error(400, message, "invalid_status", "status")
        try:
            lo, hi = window(since, until, hours)
        except BadQuery as exc:
            return _error(400, exc.message, "invalid_window", "since")
        mine = only_caller(identity(request.scope))
        if mine is not None:
            caller = mine  # a user key's history is its own, whatever it asks for
        filters: dict[str, Any] = {
            "model": model or None,
            "band": band,
            "caller": caller or None,
            "status": status,
        }
        rows, total = await asyncio.to_thread(
            q.finished_requests,
            engine,
            lo,
            hi,
            limit=max(1, min(limit, MAX_PAGE)),
            offset=max(0, min(offset, 2**62)),
            **filters,
        )
        samples = await asyncio.to_thread(q.wait_samples, engine, lo, hi, **filters)
        return _json(
            {
                "since": lo,
                "until": hi,
                "total": total,
                "rows": rows,
                "percentiles": wait_percentiles(samples),
            }
        )

    @get("/ui/api/models", response_headers=SECURITY_HEADERS)
    async def models(request: Request[Any, Any, Any]) -> Response[Any]:
        times = await asyncio.to_thread(run_times.get)
        if live is None:
            names = await asyncio.to_thread(q.models_in_log, engine) if engine else []
            rows = [{"id": m, "state": None, "median_load_s": times.swap_s.get(m)} for m in names]
            return _json({"live": False, "models": rows})
        admin = is_admin(identity(request.scope))
        waiting: dict[str, int] = {}
        for item in live.scheduler.live().state.queue:
            waiting[item.model] = waiting.get(item.model, 0) + 1
        memory = live.scheduler.memory_status()
        rows = []
        for spec in live.config.models.values():
            status = live.scheduler.model_status(spec.id)
            state: str = "loading" if status.state == "starting" else status.state
            row: dict[str, Any] = {
                "id": spec.id,
                "name": spec.name,
                "state": state,
                "pid": status.pid,
                "in_flight": status.in_flight,
                "waiting": waiting.get(spec.id, 0),
                "median_load_s": times.swap_s.get(spec.id),
                "median_run_s": times.run_s.get(spec.id),
                "check_endpoint": spec.check_endpoint or "/",
                "aliases": list(spec.aliases),
                "gpu_memory_mib": memory.footprints.get(spec.id),
                "gpu_memory_measured": spec.id in memory.measured,
            }
            if admin:  # where the upstream listens and what it printed: admin only
                row["port"] = spec.port
                row["upstream"] = spec.proxy
                lines = live.logs.lines(f"upstream:{spec.id}")[-OUTPUT_LINES:]
                row["output"] = [line.text for line in lines]
            rows.append(row)
        return _json({"live": True, "admin": admin, "models": rows, "memory": _memory(memory)})

    @get("/ui/api/requests/{request_id:str}/events", response_headers=SECURITY_HEADERS)
    async def request_events(
        request: Request[Any, Any, Any], request_id: FromPath[str]
    ) -> Response[Any]:
        if engine is None:
            return _error(503, "this server has no event log", "no_database")
        who = identity(request.scope)
        known, caller = await asyncio.to_thread(q.request_caller, engine, request_id)
        if not known or not may_see(who, caller):
            return _error(404, f"no request {request_id!r}", "request_not_found")
        rows = await asyncio.to_thread(q.request_events, engine, request_id)
        for row in rows:
            row["data"] = json.loads(row["data"])
        viewer = only_caller(who)
        if viewer is not None:
            # The ids its events name (a decision's runner-up, ...) that are not its own.
            named = set().union(*(request_ids_in(row["data"]) for row in rows))
            callers = await asyncio.to_thread(q.request_callers, engine, named)
            for row in rows:
                row["data"] = event_data_seen_by(row["data"], callers, viewer)
        return _json({"request_id": request_id, "events": rows})

    return [info, queue, timeline, history, models, request_events]


def _json(body: dict[str, Any]) -> Response[Any]:
    return Response(body, media_type=MediaType.JSON)


def _error(status: int, message: str, code: str, param: str | None = None) -> Response[Any]:
    return Response(
        error_body(status, message, code, param=param),
        status_code=status,
        media_type=MediaType.JSON,
    )


def _memory(status: MemoryStatus) -> dict[str, Any]:
    """The models page's memory bar: the GPU (null without telemetry), the memory
    router's budget (null without it), and the resident models' footprints."""
    gpu = status.gpu
    return {
        "gpu": None
        if gpu is None
        else {
            "name": gpu.name,
            "total_mib": gpu.total_mib,
            "used_mib": gpu.used_mib,
            "free_mib": gpu.free_mib,
            "utilization_pct": gpu.utilization_pct,
        },
        "budget_mib": status.budget_mib,
        "resident": [
            {"model": m, "mib": status.footprints.get(m), "measured": m in status.measured}
            for m in status.resident
        ],
    }
