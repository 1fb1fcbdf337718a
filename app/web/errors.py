"""OpenAI-style error envelope: {"src": "gpulane", "error": {"message", "type", "param", "code"}}.

`param` is always there: the field at fault, or null, as OpenAI's `Error`
requires (clients generated from its OpenAPI spec fail to read an error
without it; tests/e2e/test_openai_errors.py checks against that spec).

Every error gpulane itself answers uses it: the raw ASGI paths send it with
`send_error`, the routes return `error_response`, Litestar's own (404, 405,
validation, anything a route raises) go through `EXCEPTION_HANDLERS`, and the
HTTP protocol writes it with `error_body` for what it refuses before a request
exists (431, 408, 400). The jobs service's domain errors (app/jobs/errors.py)
become HTTP here only (`jobs_error`, `send_jobs_error`), and so do admission's
refusals (`send_refused`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap, Scope, Send

from app.jobs.errors import (
    Conflict,
    HeaderTooLarge,
    Invalid,
    JobsError,
    NoSpace,
    NotFound,
    OverCap,
    Unavailable,
)
from app.runtime.admission import Refused
from app.runtime.out_of_memory import OUT_OF_MEMORY
from app.runtime.upstream import UpstreamStartError

log = logging.getLogger("gpulane.http")

ERROR_SOURCE = "gpulane"
"""`src` of every error gpulane itself answers (llama-swap's says "llama-swap")."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    403: "permission_error",
    409: "conflict_error",
    413: "request_too_large",
    431: "request_too_large",
    502: "upstream_error",
    503: "service_unavailable",
    507: "insufficient_storage",
}
_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    500: "internal_error",
}


def error_doc(
    status: int,
    message: str,
    code: str | None = None,
    *,
    kind: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The envelope. `kind` overrides the status's type where OpenAI's own shape
    says otherwise; `param` names the field at fault (None for none)."""
    kind = kind or _TYPES.get(status, "server_error")
    error = {"message": message, "type": kind, "param": param, "code": code or kind}
    # llama-swap's `src` tells the proxy's own errors from an upstream's answer.
    return {"src": ERROR_SOURCE, "error": error}


def error_body(
    status: int, message: str, code: str | None = None, *, param: str | None = None
) -> bytes:
    return msgspec.json.encode(error_doc(status, message, code, param=param))


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    *,
    kind: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response[bytes]:
    """The envelope as a Litestar response, for the routes (`error_doc`)."""
    return Response(
        msgspec.json.encode(
            error_doc(status, message, code or _CODES.get(status), kind=kind, param=param)
        ),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


_JOBS_STATUS: dict[type[JobsError], int] = {
    Invalid: 400,
    NotFound: 404,
    Conflict: 409,
    OverCap: 429,
    HeaderTooLarge: 431,
    Unavailable: 503,
    NoSpace: 507,
}
"""The jobs service's errors (app/jobs/errors.py) as HTTP statuses: the one mapping."""


def jobs_status(exc: JobsError) -> int:
    return _JOBS_STATUS[type(exc)]


def jobs_error(exc: JobsError, headers: list[tuple[bytes, bytes]] | None = None) -> Response[bytes]:
    """A jobs-service refusal as a response (`headers`: its X-Request-Id, if recorded)."""
    named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers or []}
    return error_response(
        jobs_status(exc), exc.message, exc.code, param=exc.param, headers=named or None
    )


async def send_jobs_error(
    send: Send, exc: JobsError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_error(
        send, jobs_status(exc), exc.message, code=exc.code, param=exc.param, headers=headers
    )


async def send_refused(send: Send, exc: Refused) -> None:
    """An admission refusal (the queue's bounds, a draining server), with its
    Retry-After and, once recorded, the X-Request-Id of its record."""
    headers = retry_after(exc.retry_after) + request_id_header(exc.recorded_as)
    await send_error(send, exc.status, str(exc), code=exc.code, headers=headers)


def request_id_header(request_id: str | None) -> list[tuple[bytes, bytes]]:
    """`X-Request-Id` naming a refusal's `request_rejected` record, or nothing."""
    return [] if request_id is None else [(b"x-request-id", request_id.encode())]


def start_failure(failure: BaseException) -> tuple[int, str]:
    """The status and code of a request whose model failed to start (`failure`,
    its ticket's exception): 503 `upstream_out_of_memory` when its server ran out
    of GPU memory, 502 `upstream_start_failed` for another load failure, 500 for
    anything else."""
    if not isinstance(failure, UpstreamStartError):
        return 500, "upstream_start_failed"
    return (502, "upstream_start_failed") if failure.out_of_memory is None else OUT_OF_MEMORY


def retry_after(seconds: int | None) -> list[tuple[bytes, bytes]]:
    """A `Retry-After` header (whole seconds), or none."""
    return [] if seconds is None else [(b"retry-after", str(seconds).encode())]


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send_json(send, status, error_body(status, message, code, param=param), headers)


async def send_websocket_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """The envelope as the answer to a websocket upgrade refused before it
    opens (after its `websocket.connect` was received)."""
    body = error_body(status, message, code)
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    await send_websocket_refusal(scope, send, status, head, body)


async def send_websocket_refusal(
    scope: Scope, send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """An HTTP answer to an upgrade where the server can send one (ASGI's
    `websocket.http.response`), else a close with 1008 (policy violation)."""
    raw: Any = send  # raw ASGI messages, which Send's types do not list
    with contextlib.suppress(Exception):  # the client may be gone already
        if "websocket.http.response" not in (scope.get("extensions") or {}):
            await raw({"type": "websocket.close", "code": 1008})
            return
        await raw({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await raw({"type": "websocket.http.response.body", "body": body})


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON response on a raw ASGI `send`."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    where = f"{request.method} {request.url.path}"
    generic = exc.detail == HTTPStatus(status).phrase  # Litestar's default: says nothing
    if status == 404 and generic:
        message = (
            f"no route {where}: the OpenAI routes are under /v1/, "
            "a model's own server under /upstream/MODEL/"
        )
    elif status == 405 and generic:
        allowed = (exc.headers or {}).get("allow", "")
        message = (
            f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
        )
    elif isinstance(exc, ValidationException) and isinstance(exc.extra, list):
        # Litestar's detail says only "Validation failed"; the parameters are in `extra`.
        found = [p for p in exc.extra if isinstance(p, dict)]
        problems = "; ".join(_problem(request, p) for p in found)
        message = f"invalid request to {where}: {problems}" if problems else exc.detail
        param = str(found[0]["key"]) if found and found[0].get("key") else None
        return error_response(status, message, param=param, headers=exc.headers)
    else:
        message = exc.detail
    if status >= 500:
        log.error("%s failed with %d: %s", where, status, exc.detail, exc_info=exc)
    return error_response(status, message, headers=exc.headers)


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text"}
"""msgspec's type names in a validation message, as a caller reads them."""
_EXPECTED_TYPE = re.compile(r"Expected `([^`]*)`")


def _problem(request: Request[Any, Any, Any], problem: dict[str, Any]) -> str:
    """`query parameter 'limit' is 'abc': expected an integer`: the parameter,
    the value sent (cut short) and what it takes. msgspec says `got str` of
    every query value, which tells the caller nothing."""
    source = getattr(problem.get("source"), "value", problem.get("source"))
    key = str(problem.get("key", "?"))
    said = str(problem.get("message", "invalid"))
    expected = _EXPECTED_TYPE.match(said)
    if expected is not None:
        kinds = [k.strip() for k in expected.group(1).split("|") if k.strip() != "null"]
        said = "expected " + " or ".join(_EXPECTED.get(k, f"`{k}`") for k in kinds)
    where = f"{source} parameter {key!r}" if source else repr(key)
    given = _given(request, source, key)
    return f"{where}{'' if given is None else f' is {given}'}: {said}"


def _given(request: Request[Any, Any, Any], source: str | None, key: str) -> str | None:
    """The value the client sent for a query or path parameter, quoted and cut short."""
    if source == "query":
        value = request.query_params.get(key)
    elif source == "path":
        value = request.path_params.get(key)
    else:
        return None
    if value is None:
        return None
    text = str(value)
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    # The traceback goes to the log only: it is for the operator, not the caller.
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(
        500,
        f"internal error while handling {request.method} {request.url.path} "
        f"({type(exc).__name__}); the gpulane log has the traceback",
        "internal_error",
    )


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    HTTPException: _http_exception,
    Exception: _unexpected,
}
"""For `Litestar(exception_handlers=...)`: errors Litestar raises or a route lets escape."""
