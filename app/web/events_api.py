"""`GET /api/events`: llama-swap's Server-Sent Events stream, in its shapes
(its `internal/server/apigroup.go`, `handleAPIEvents`), as its UI
(`ui/src/stores/api.ts`) and `cmd/wol-proxy` read it.

Each event is `event:message` with `data:` an envelope `{"type", "data"}`
whose `data` is itself a JSON string:

- `modelStatus`: every model, sorted by id (`id`, `name`, `description`,
  `state`, `unlisted`, `peerID`, `aliases`), then the peers' models; sent
  first and again whenever a state changes.
- `logData`: `{"source": "proxy" | "upstream", "data": text}`; first the lines
  held, one event per source, then each new line.
- `inflight`: a `snapshot` of the running requests, first and on each change.
- `uiConfig` and `profileChanged` once, as llama-swap's defaults (gpulane
  ignores `ui` and `profiles`).

Nothing here makes the scheduler or the log wait: model states and running
requests are read from the scheduler's views every `POLL_S`, and log lines come
through a bounded subscription that drops the oldest when the client reads
slower than they come (counted, and logged when the stream ends). The stream
ends when the client leaves or gpulane drains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from litestar import Response, get
from litestar.handlers import BaseRouteHandler
from litestar.response import Stream

from app.config import Config
from app.runtime.log_buffer import LogBuffer, LogLine
from app.runtime.scheduler import Scheduler
from app.web.access import admin_only

log = logging.getLogger("gpulane.events")

POLL_S = 0.25
"""How often model states and running requests are compared with what was sent."""
QUEUE_LINES = 1024
"""New log lines held for a slow client before the oldest are dropped (llama-swap: 1024)."""

UI_CONFIG = {"activity": {"session_id": ["X-Session-ID", "X-Litellm-Session-Id"]}}
"""llama-swap's default `ui` block."""

HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Content-Type-Options": "nosniff",
    "X-Accel-Buffering": "no",
}


def envelope(kind: str, data: Any) -> bytes:
    """One SSE event in llama-swap's framing (no space after the colons)."""
    body = json.dumps({"type": kind, "data": json.dumps(data, separators=(",", ":"))})
    return b"event:message\ndata:" + body.encode() + b"\n\n"


def model_status(config: Config, scheduler: Scheduler) -> list[dict[str, Any]]:
    """llama-swap's `modelStatus` list: local models by id, then peers' models."""
    local: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    for spec in sorted(config.models.values(), key=lambda s: s.id):
        if spec.choices:
            continue  # a bare id several peers serve: each peer's entry is listed
        row: dict[str, Any] = {
            "id": spec.id,
            "name": "",
            "description": "",
            "state": "",
            "unlisted": False,
            "peerID": spec.peer or "",
        }
        if spec.peer is not None:
            peers.append(row)
            continue
        row["name"] = spec.name or ""
        row["description"] = spec.description or ""
        row["state"] = scheduler.model_status(spec.id).state
        row["unlisted"] = spec.unlisted
        if spec.aliases:
            row["aliases"] = list(spec.aliases)
        local.append(row)
    return local + peers


def inflight_snapshot(scheduler: Scheduler) -> dict[str, Any]:
    """llama-swap's `inflight` snapshot: the requests running now, oldest first."""
    live = scheduler.live()
    rows = []
    for request in live.state.requests.values():
        if not request.running or request.dispatched_ns is None:
            continue
        rows.append(
            {
                "id": request.request_id,
                "timestamp": _rfc3339(request.dispatched_ns),
                "model": request.model,
                "req_path": request.endpoint,
                "method": "",
                "req_headers": {},
                "remote_ip": "",
                "resp_headers": {},
                "resp_bytes": 0,
                "elapsed_ms": max(0, (live.now_ns - request.dispatched_ns) // 1_000_000),
            }
        )
    rows.sort(key=lambda row: (row["timestamp"], row["id"]))
    return {"operation": "snapshot", "requests": rows}


def _rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat().replace("+00:00", "Z")


def _log_source(line: LogLine) -> str:
    return "proxy" if line.source == "proxy" else "upstream"


async def event_stream(
    config: Config, scheduler: Scheduler, logs: LogBuffer, poll_s: float = POLL_S
) -> AsyncIterator[bytes]:
    # Subscribed with the history in one step, so no line is missed or sent twice.
    held = len(logs)
    async with logs.subscribe(maxsize=held + QUEUE_LINES, backlog=held) as lines:
        history: dict[str, list[str]] = {"proxy": [], "upstream": []}
        for _ in range(held):
            line = await lines.get()  # already queued: no wait
            if line is not None:
                history[_log_source(line)].append(line.text + "\n")
        for source, texts in history.items():
            yield envelope("logData", {"source": source, "data": "".join(texts)})
        models = model_status(config, scheduler)
        yield envelope("modelStatus", models)
        yield envelope("uiConfig", UI_CONFIG)
        yield envelope("profileChanged", {"active": None})
        inflight = inflight_snapshot(scheduler)
        yield envelope("inflight", inflight)
        running = [row["id"] for row in inflight["requests"]]
        next_poll = time.monotonic() + poll_s
        try:
            while not scheduler.draining:
                timeout = max(0.0, next_poll - time.monotonic())
                try:
                    line = await asyncio.wait_for(lines.get(), timeout)
                except TimeoutError:
                    line = None
                if line is not None:
                    text = line.text + "\n"
                    yield envelope("logData", {"source": _log_source(line), "data": text})
                if time.monotonic() < next_poll:
                    continue
                next_poll = time.monotonic() + poll_s
                now = model_status(config, scheduler)
                if now != models:
                    models = now
                    yield envelope("modelStatus", models)
                inflight = inflight_snapshot(scheduler)
                ids = [row["id"] for row in inflight["requests"]]
                if ids != running:
                    running = ids
                    yield envelope("inflight", inflight)
        finally:
            if lines.dropped:
                log.warning("/api/events: a slow client missed %d log lines", lines.dropped)


def events_routes(config: Config, scheduler: Scheduler, logs: LogBuffer) -> list[BaseRouteHandler]:
    # Admin only, as /logs is: the log lines show every caller's work.
    @get("/api/events", sync_to_thread=False, guards=[admin_only])
    def events() -> Response[Any]:
        return Stream(
            event_stream(config, scheduler, logs),
            media_type="text/event-stream",
            headers=HEADERS,
        )

    return [events]
