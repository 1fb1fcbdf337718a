"""Background responses: the Responses API's `background: true` on durable jobs.

A third door onto the one mechanism (docs/jobs.md): `POST /v1/responses` with
`background: true` is admitted exactly as `Prefer: respond-async` admits a
request (its body stored once, its enqueue on disk before the answer), less
the `background` field, which is gpulane's to honour, not the upstream's.
The answer is a Response object with `status: "queued"`; its id is the job's
id with OpenAI's `resp_` prefix, so no table maps one to the other. Polling it
(`GET /v1/responses/{id}`) reads the job: queued, in_progress (running),
then the upstream's own Response once completed (with this id), failed
(the job failed, or the upstream answered an error), or cancelled
(`POST /v1/responses/{id}/cancel`). The job carries `door: "background"`,
so only such jobs answer here; a user key sees only its own (app/web/access.py).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath

from app.jobs.durable import Jobs
from app.jobs.errors import JobsError
from app.web.access import identity, only_caller
from app.web.errors import error_response

DOOR = "background"
PREFIX = "resp_"

_STATUSES = {
    "queued": "queued",
    "running": "in_progress",
    "completed": "completed",
    "failed": "failed",
    "abandoned": "failed",
    "cancelled": "cancelled",
}


def is_background(path: str, doc: dict[str, Any] | None) -> bool:
    """Whether a request to the (forwarded) `path` asks for a background response."""
    return path == "/v1/responses" and doc is not None and doc.get("background") is True


def response_id(request_id: str) -> str:
    return PREFIX + request_id


def request_id_of(response: str) -> str | None:
    return response[len(PREFIX) :] if response.startswith(PREFIX) else None


def response_object(view: dict[str, Any]) -> dict[str, Any]:
    """A job's view (app/jobs/job_view.py) as the Response object the official client parses."""
    status = _STATUSES.get(str(view.get("status")), "queued")
    out: dict[str, Any] = {
        "id": response_id(view["id"]),
        "object": "response",
        "created_at": int(view.get("enqueued_at") or 0),
        "status": status,
        "background": True,
        "model": view.get("model"),
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": None,
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
    }
    result = view.get("result")
    if status == "completed" and isinstance(result, dict):
        body = result.get("body")
        code = int(result.get("http_status") or 0)
        if 200 <= code < 300 and isinstance(body, dict):
            upstream_status = body.get("status")
            out |= {k: v for k, v in body.items() if k not in ("id", "object", "background")}
            out["status"] = upstream_status if upstream_status == "incomplete" else "completed"
            out["created_at"] = int(view.get("enqueued_at") or out["created_at"])
        else:
            out["status"] = "failed"
            out["error"] = {"code": "server_error", "message": _upstream_error(code, body)}
    elif status == "failed":
        message = view.get("error") or f"job {view['id']} {view.get('status')}"
        out["error"] = {"code": "server_error", "message": message}
    if "position" in view:
        out["gpulane"] = {"position": view["position"], "job": f"/v1/jobs/{view['id']}"}
    else:
        out["gpulane"] = {"job": f"/v1/jobs/{view['id']}"}
    return out


def _upstream_error(code: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        detail = body["error"].get("message")
    else:
        detail = body if isinstance(body, str) else None
    return f"the upstream answered {code}" + (f": {detail}" if detail else "")


def _not_found(response: str) -> Response[bytes]:
    # OpenAI's own answer for an unknown response: an invalid request, with `param`.
    message = f"no background response {response}"
    return error_response(
        404, message, "response_not_found", kind="invalid_request_error", param=None
    )


def response_routes(jobs: Jobs) -> list[BaseRouteHandler]:
    async def owned(request: Request[Any, Any, Any], response: str) -> dict[str, Any] | None:
        request_id = request_id_of(response)
        if request_id is None:
            return None
        view = await jobs.view_for(only_caller(identity(request.scope)), request_id)
        if view is None or view.get("door") != DOOR:
            return None
        return view

    @get("/v1/responses/{response:str}")
    async def retrieve(request: Request[Any, Any, Any], response: FromPath[str]) -> Response[Any]:
        view = await owned(request, response)
        if view is None:
            return _not_found(response)
        return Response(response_object(view))

    @post("/v1/responses/{response:str}/cancel", status_code=200)
    async def cancel(request: Request[Any, Any, Any], response: FromPath[str]) -> Response[Any]:
        view = await owned(request, response)
        if view is None:
            return _not_found(response)
        if view.get("status") in ("queued", "running"):
            try:
                view = await jobs.cancel(only_caller(identity(request.scope)), view["id"])
            except JobsError:
                pass  # it ended meanwhile: answered as it is
        # An ended response is answered as it is: cancelling twice is harmless.
        return Response(response_object(view))

    return [retrieve, cancel]
