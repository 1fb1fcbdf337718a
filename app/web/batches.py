"""The OpenAI Batch API's routes (`/v1/batches`): its requests read, its objects shaped.

What a batch is and does (its lines as durable jobs, its watcher, its files,
its progress) is the jobs service's (app/jobs/batches.py); here are the
request's checks, in OpenAI's order and words, and the Batch object. Errors
name the field at fault (`param`), as OpenAI's do.
"""

from __future__ import annotations

import json
from typing import Any

from litestar import Request, Response, get, post
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery

from app.config import Config
from app.core.priority import HEADER, grant, read_priority
from app.jobs.batch_input import BATCH_ENDPOINTS, completion_window_s
from app.jobs.batches import (
    BATCH_PRIORITY,
    Batches,
    BatchOrder,
    BatchState,
    EncodeLine,
    batch_default,
)
from app.jobs.errors import Invalid, JobsError
from app.web.access import identity, only_caller
from app.web.auth import Identity, identify
from app.web.errors import error_response, jobs_error
from app.web.refusals import Asked, record, record_jobs_error
from app.web.request_body import BadRequest, rewrite

_MAX_REQUEST = 1 << 20
ENDPOINT = "/v1/batches"


def line_encoder(config: Config) -> EncodeLine:
    """A batch line's body as its model's settings send it (useModelName, filters)."""

    def encode(model: str, doc: dict[str, Any]) -> bytes:
        changed = rewrite(doc, config.models[model])
        return json.dumps(changed if changed is not None else doc).encode()

    return encode


def batch_order(who: Identity, doc: Any, asked_header: int | None) -> BatchOrder:
    """The batch `doc` asks for; Invalid naming the field at fault."""
    if not isinstance(doc, dict):
        raise Invalid("the request body must be a JSON object", "invalid_request")
    endpoint = doc.get("endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise Invalid(
            f"endpoint {endpoint!r} is not one of {', '.join(BATCH_ENDPOINTS)}",
            "invalid_endpoint",
            "endpoint",
        )
    window = doc.get("completion_window", "24h")
    window_s = completion_window_s(window)
    if window_s is None:
        raise Invalid(
            f"completion_window {window!r} is not a duration such as '24h', '30m' or "
            "'7d' (at most 366d)",
            "invalid_completion_window",
            "completion_window",
        )
    metadata = doc.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise Invalid("metadata must be an object of strings", "invalid_metadata", "metadata")
    asked = asked_header
    if asked is None and metadata and "priority" in metadata:
        asked = read_priority(metadata["priority"])
        if asked is None:
            raise Invalid(
                f"metadata.priority {metadata['priority']!r} is not a priority: an integer "
                "or interactive, normal, batch",
                "invalid_priority",
                "metadata",
            )
    return BatchOrder(
        caller=who.caller,
        only=only_caller(who),
        endpoint=endpoint,
        input_file_id=doc.get("input_file_id"),
        completion_window=window,
        window_s=window_s,
        metadata=metadata,
        priority=grant(asked, who.max_priority, batch_default(who.default_priority)),
    )


def batch_object(state: BatchState) -> dict[str, Any]:
    """A batch in OpenAI's shape (plus its `priority` and `caller`)."""
    batch, counts = state.batch, state.counts
    total, ended = counts["total"], counts["ended"]
    status = batch["status"]
    if status == "in_progress" and total and ended == total:
        status = "finalizing"  # its files are being written

    def at(name: str) -> int | None:
        value = batch[name]
        return None if value is None else int(value)

    return {
        "id": batch["id"],
        "object": "batch",
        "endpoint": batch["endpoint"],
        "errors": batch["errors"],
        "input_file_id": batch["input_file_id"],
        "completion_window": batch["completion_window"],
        "status": status,
        "output_file_id": batch["output_file_id"],
        "error_file_id": batch["error_file_id"],
        "created_at": int(batch["created_at"]),
        "in_progress_at": at("in_progress_at"),
        "expires_at": at("expires_at"),
        "finalizing_at": at("finalizing_at"),
        "completed_at": at("completed_at"),
        "failed_at": at("failed_at"),
        "expired_at": at("expired_at"),
        "cancelling_at": at("cancelling_at"),
        "cancelled_at": at("cancelled_at"),
        "request_counts": {
            "total": total,
            "completed": counts["succeeded"],
            "failed": ended - counts["succeeded"],
        },
        "metadata": batch["metadata"],
        "priority": batch["priority"],
        "caller": batch["caller"],
    }


def _batch_priority(who: Identity, asked_header: int | None) -> int:
    """The priority a batch's lines get when its body does not say (metadata.priority)."""
    return grant(asked_header, who.max_priority, batch_default(who.default_priority))


def _named(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}


def batch_routes(batches: Batches) -> list[BaseRouteHandler]:
    async def with_progress(state: BatchState) -> dict[str, Any]:
        doc = batch_object(state)
        doc["gpulane_progress"] = await batches.progress.of_counts(state.batch, state.counts)
        return doc

    @post("/v1/batches", status_code=200)
    async def create(request: Request[Any, Any, Any]) -> Response[Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        asked_header = read_priority(headers.get(HEADER.lower()))
        # A refusal is recorded (app/web/refusals.py) at the priority its lines would have.
        asked = Asked(ENDPOINT, priority=grant(asked_header, None, BATCH_PRIORITY))

        def refused(status: int, message: str, code: str) -> Response[Any]:
            named = _named(record(batches.scheduler, asked, status, message))
            return error_response(status, message, code, param=None, headers=named)

        try:
            who = identify(request.scope, headers)
            asked = Asked(ENDPOINT, None, _batch_priority(who, asked_header), who.caller)
            raw = await request.body()
            if len(raw) > _MAX_REQUEST:
                return refused(413, "the request body is too large", "request_too_large")
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                return refused(400, f"the body is not JSON: {exc}", "invalid_json")
            order = batch_order(who, doc, asked_header)
            asked = Asked(ENDPOINT, None, order.priority, who.caller)
            return Response(batch_object(await batches.create(order)))
        except BadRequest as exc:
            named = _named(record(batches.scheduler, asked, exc.status, exc.message))
            return error_response(exc.status, exc.message, exc.code, param=exc.param, headers=named)
        except JobsError as exc:
            return jobs_error(exc, record_jobs_error(batches.scheduler, asked, exc))

    @get("/v1/batches")
    async def listing(
        request: Request[Any, Any, Any],
        limit: FromQuery[int] = 20,
        after: FromQuery[str | None] = None,
    ) -> Response[Any]:
        only = only_caller(identity(request.scope))
        states, more = await batches.listing(only, max(1, min(limit, 100)), after)
        data = [await with_progress(state) for state in states]
        return Response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    @get("/v1/batches/{batch_id:str}")
    async def retrieve(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
        try:
            state = await batches.state_seen_by(only_caller(identity(request.scope)), batch_id)
        except JobsError as exc:
            return jobs_error(exc)
        return Response(await with_progress(state))

    @post("/v1/batches/{batch_id:str}/cancel", status_code=200)
    async def cancel(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
        try:
            state = await batches.cancel(only_caller(identity(request.scope)), batch_id)
        except JobsError as exc:
            return jobs_error(exc)
        return Response(batch_object(state))

    return [create, listing, retrieve, cancel]
