"""What a batch writes, in OpenAI's shapes: its validation errors, and each
line's entry in its output or error file. Pure: rows in, documents out."""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import RowMapping

from app.jobs.batch_input import MAX_ERRORS, LineError
from app.jobs.job_view import body_for_json


def validation_errors(errors: list[LineError]) -> dict[str, Any]:
    """A failed batch's `errors`: the first MAX_ERRORS, and how many more."""
    data = [msgspec.to_builtins(e) for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        data.append(
            {
                "code": "too_many_errors",
                "message": f"{len(errors) - MAX_ERRORS} more errors not listed",
                "line": None,
                "param": None,
            }
        )
    return {"object": "list", "data": data}


def cancelled_error() -> dict[str, Any]:
    return {"code": "batch_cancelled", "message": "the batch was cancelled before this line ran"}


def answer(o: RowMapping, cancelling: bool) -> tuple[dict[str, Any], bool]:
    """A line's entry in the output (True) or error file (False)."""
    rid = o["request_id"]
    entry: dict[str, Any] = {
        "id": f"batch_req_{rid or o['line']}",
        "custom_id": o["custom_id"],
        "response": None,
        "error": None,
    }
    if rid is None:
        entry["error"] = o["line_error"]
        return entry, False
    status = o["status"]
    if status == "completed":
        if o["result_status"] is None:
            entry["error"] = {
                "code": "result_pruned",
                "message": f"job {rid}'s answer is no longer kept (jobs.resultRetention)",
            }
            return entry, False
        entry["response"] = {
            "status_code": o["result_status"],
            "request_id": rid,
            "body": body_for_json(o["result_body"]),
        }
        return entry, 200 <= o["result_status"] < 300
    if status == "cancelled" and o["cancel_reason"] == "deadline":
        entry["error"] = {
            "code": "batch_expired",
            "message": "this request could not be run before the batch's completion window ended",
        }
    elif status == "cancelled" and cancelling:
        entry["error"] = cancelled_error()
    else:
        message = o["error"] or f"job {rid} ended {status}"
        if status == "cancelled":
            message = f"job {rid} was cancelled ({o['cancel_reason']})"
        entry["error"] = {"code": f"request_{status}", "message": message}
    return entry, False
