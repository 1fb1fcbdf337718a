"""A durable job as its callers read it (`/v1/jobs/{id}`): the read model's row,
overlaid with the live state for an open job (the log commits in groups; the
live state is never behind), and its stored answer."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec

from app.report.explain import request_fields
from app.runtime.api import OpenStatus

_ROW_FIELDS = (
    "status",
    "model",
    "priority",
    "band",
    "caller",
    "attempt",
    "durable",
    "enqueued_at",
    "dispatched_at",
    "started_at",
    "finished_at",
    "http_status",
    "error",
)


def seen_by(only: str | None, caller: str | None) -> bool:
    """Whether a viewer who sees `only` that caller's work (None: everyone's,
    app/web/access.py `only_caller`) sees work of `caller`."""
    return only is None or only == caller


def job_view(
    request_id: str,
    row: Any,
    result: Any,
    live: OpenStatus | None,
    live_caller: str | None,
    ahead: int | None = None,
) -> dict[str, Any] | None:
    """The view, or None when neither the log nor the live state knows the job;
    `live_caller` is the caller of an open job not yet in the read model; `ahead`
    its place while it waits (`Scheduler.ahead`), when asked for."""
    if live is None and row is None:
        return None
    out: dict[str, Any] = {"id": request_id, "object": "job"}
    if row is None:
        out["caller"] = live_caller
    else:
        out.update(request_fields(row, _ROW_FIELDS))
        out["durable"] = bool(row["durable"])
        door = (row["job"] or {}).get("door")
        if door is not None:
            out["door"] = door
    if live is not None:
        out.update(status=live.status, attempt=live.attempt)
        if ahead is not None:
            out["position"] = ahead
        if live.score is not None:
            out["score"] = msgspec.to_builtins(live.score)
    if result is not None:
        out["result"] = {
            "http_status": result["http_status"],
            "headers": dict(json.loads(result["headers"])),
            "body": body_for_json(result["body"]),
        }
    return out


def body_for_json(body: bytes | None) -> Any:
    """An upstream's answer inside a JSON document: parsed if it is JSON, else
    its text, else `{"base64": ...}`."""
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        pass
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(body).decode()}
