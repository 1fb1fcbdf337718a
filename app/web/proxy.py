"""The proxy path: admit a request, wait for its turn, stream the upstream's answer.

Raw ASGI on purpose: the body must pass through byte for byte, chunks must be
forwarded as the upstream sends them, and a client that leaves must be noticed
while it waits in the queue, which Litestar's request objects do not expose.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from litestar.types import Message, Receive, Scope, Send

from app.config import Config
from app.core.priority import HEADER, grant, read_priority, tier_priority, unreadable_priority
from app.jobs.durable import JobRequest
from app.runtime.admission import Refused
from app.runtime.api import Admission, Detached, Ticket
from app.runtime.scheduler import Scheduler
from app.web.access_log import note_model
from app.web.auth import ANONYMOUS, identify
from app.web.chain_headers import read_chain
from app.web.comfyui_routes import ComfyDoor
from app.web.errors import send_error, send_refused, start_failure
from app.web.forward import Forwarder, Reply, ticket_headers, upstream_url
from app.web.jobs import JobDoor
from app.web.model_routes import forwarded_path
from app.web.refusals import Asked, asked_by, record
from app.web.request_body import (
    BadRequest,
    form_model,
    json_model,
    max_wait_ns,
    query_model,
    read_body,
    rename_form_model,
    rewrite,
)
from app.web.responses import DOOR, is_background

log = logging.getLogger("gpulane.proxy")


class Proxy:
    def __init__(self, config: Config, scheduler: Scheduler, forwarder: Forwarder) -> None:
        self.config = config
        self.scheduler = scheduler
        self.forwarder = forwarder
        self.jobs: JobDoor | None = None
        """Set by serve: takes requests sent with `Prefer: respond-async` or
        `background: true` (app/web/jobs.py)."""
        self.renders: ComfyDoor | None = None
        """Set by serve: answers `/upstream/MODEL/...` for a model with `kind:
        comfyui` (app/web/comfyui_routes.py)."""

    def handler(
        self, source: Literal["json", "form", "query"]
    ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def handle(scope: Scope, receive: Receive, send: Send) -> None:
            await self.inference(scope, receive, send, source)

        return handle

    async def inference(self, scope: Scope, receive: Receive, send: Send, source: str) -> None:
        """A model-dispatched route (app/web/model_routes.py): the model is read
        from the JSON body, a form field or (`query`) the query string."""
        headers = _headers(scope)
        endpoint = scope["path"]
        asked = read_priority(headers.get(HEADER.lower()))
        identity = ANONYMOUS
        priority = grant(asked)
        model_requested: str | None = None
        try:
            identity = identify(scope, headers)
            priority = identity.grant(asked)
            max_wait = max_wait_ns(headers)
            chain, chain_length = read_chain(headers)
            body = await read_body(receive, self.config.max_body_bytes)
            doc: dict[str, Any] | None = None
            if source == "query":
                model_requested = query_model(scope.get("query_string", b""))
            elif source == "form":
                model_requested = form_model(body, headers.get("content-type", ""))
            else:
                doc, model_requested = json_model(body)
                asked = _with_service_tier(asked, doc)
                priority = identity.grant(asked)
            note_model(scope, model_requested)
            model = self.config.resolve_model(model_requested)
            if model is None:
                listed = sorted(m.id for m in self.config.models.values() if not m.unlisted)
                raise BadRequest(
                    404,
                    f"model {model_requested!r} is not configured; available: {', '.join(listed)}",
                    "model_not_found",
                    "model",
                )
            spec = self.config.models[model]
            if source == "form" and spec.use_model_name and spec.use_model_name != model_requested:
                body = rename_form_model(body, headers["content-type"], spec.use_model_name)
            elif doc is not None:
                changed = rewrite(doc, spec, model_requested)
                if changed is not None:
                    body = json.dumps(changed).encode()
        except BadRequest as exc:
            refused = Asked(endpoint, model_requested, priority, identity.caller)
            recorded = record(self.scheduler, refused, exc.status, exc.message)
            await send_error(
                send, exc.status, exc.message, code=exc.code, param=exc.param, headers=recorded
            )
            return
        except ConnectionError:
            return
        admission = Admission(
            model=model,
            model_requested=model_requested,
            endpoint=endpoint,
            priority=priority,
            requested_priority=asked,
            priority_unreadable=unreadable_priority(headers.get(HEADER.lower())),
            caller=identity.caller,
            max_wait_ns=max_wait,
            chain=chain,
            chain_length=chain_length,
        )
        path = forwarded_path(endpoint)
        job = None
        if self.jobs is not None and is_background(path, doc):
            # The Responses API's `background: true`: a durable job (app/web/responses.py).
            assert doc is not None
            if doc.get("stream") is True:
                message = "background responses are not streamed here; poll GET /v1/responses/{id}"
                recorded = record(self.scheduler, asked_by(admission), 400, message)
                await send_error(
                    send,
                    400,
                    message,
                    code="unsupported_parameter",
                    param="stream",
                    headers=recorded,
                )
                return
            # The body as rewritten for the model (useModelName, filters), less `background`.
            sent = json.loads(body)
            body = json.dumps({k: v for k, v in sent.items() if k != "background"}).encode()
            job = JobRequest(
                method="POST", path=path, query=_query(scope), body=body, headers=headers, door=DOOR
            )
        progress = (
            spec.send_loading_state
            and path == "/v1/chat/completions"
            and doc is not None
            and doc.get("stream") is True
        )
        await self._run(
            scope,
            receive,
            send,
            admission,
            body,
            headers,
            upstream_path=path,
            progress=progress,
            job=job,
        )

    async def upstream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/upstream/{model}/{path}: any method, passed through to that model's server."""
        params = scope["path_params"]
        model = self.config.resolve_model(params["model"])
        path = "/" + params.get("path", "").lstrip("/")
        endpoint = "/upstream" + path
        if model is None:
            message = f"model {params['model']!r} is not configured"
            recorded = record(self.scheduler, Asked(endpoint, params["model"]), 404, message)
            await send_error(send, 404, message, code="model_not_found", headers=recorded)
            return
        if self.renders is not None and self.config.models[model].kind == "comfyui":
            # A render server: its prompts are held jobs, its other paths never load it.
            await self.renders.handle(scope, receive, send, model, path)
            return
        # re's own cache compiles it once per pattern, so a reload's new one applies.
        if re.search(self.config.ignore_paths, path) and not self.scheduler.is_resident(model):
            # A browser asking for a favicon must not trigger a model swap.
            await send_error(
                send,
                409,
                f"model {model!r} is not loaded; static paths do not load it",
                code="model_not_loaded",
            )
            return
        headers = _headers(scope)
        asked = read_priority(headers.get(HEADER.lower()))
        identity = ANONYMOUS
        try:
            identity = identify(scope, headers)
            max_wait = max_wait_ns(headers)
            chain, chain_length = read_chain(headers)
            body = await read_body(receive, self.config.max_body_bytes)
        except BadRequest as exc:
            refused = Asked(endpoint, params["model"], identity.grant(asked), identity.caller)
            recorded = record(self.scheduler, refused, exc.status, exc.message)
            await send_error(
                send, exc.status, exc.message, code=exc.code, param=exc.param, headers=recorded
            )
            return
        except ConnectionError:
            return
        admission = Admission(
            model=model,
            model_requested=params["model"],
            endpoint=endpoint,
            priority=identity.grant(asked),
            requested_priority=asked,
            priority_unreadable=unreadable_priority(headers.get(HEADER.lower())),
            caller=identity.caller,
            max_wait_ns=max_wait,
            chain=chain,
            chain_length=chain_length,
        )
        await self._run(scope, receive, send, admission, body, headers, upstream_path=path)

    # -- one admitted request ---------------------------------------------------

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        admission: Admission,
        body: bytes,
        headers: dict[str, str],
        upstream_path: str | None = None,
        progress: bool = False,
        job: JobRequest | None = None,
    ) -> None:
        """Run the request now, or hand it to the job door: `job` (a background
        response), or one sent with `Prefer: respond-async`."""
        if job is None and "respond-async" in headers.get("prefer", "").lower():
            job = JobRequest(
                method=str(scope.get("method", "POST")),
                path=upstream_path or scope["path"],
                query=_query(scope),
                body=body,
                headers=headers,
            )
        if self.jobs is not None and job is not None:
            await self.jobs.accept(send, admission, job)
            return
        try:
            ticket = self.scheduler.admit(admission)
        except Refused as exc:
            self.scheduler.refused(admission, exc)
            await send_refused(send, exc)
            return
        current = asyncio.current_task()
        assert current is not None
        # Whatever this handler does from here, the request ends when it does.
        self.scheduler.supervise(ticket.request_id, current)
        disconnected: asyncio.Future[None] = asyncio.ensure_future(_wait_disconnect(receive))
        out = Reply(
            send,
            ticket,
            requested_priority=admission.requested_priority,
            priority_unreadable=admission.priority_unreadable,
        )
        try:
            waiting: list[asyncio.Future[Any]] = [ticket.ready, disconnected, ticket.detached]
            if progress:
                # Requests served at once get no progress lines.
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=0.05)
            if progress and not any(f.done() for f in waiting):
                # sendLoadingState: the stream starts now and says where the request stands.
                out = Reply(
                    await self._send_progress(send, ticket, admission, waiting),
                    ticket,
                    started_as_sse=True,
                    requested_priority=admission.requested_priority,
                    priority_unreadable=admission.priority_unreadable,
                )
            if not any(f.done() for f in waiting):  # usually dispatched at its admission
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if ticket.detached.done():
                await out.error(ticket.detached.result())
                return
            if not ticket.ready.done():
                self.scheduler.client_gone(ticket.request_id)
                return
            if ticket.ready.cancelled():
                return
            failure = ticket.ready.exception()
            if failure is not None:
                message = f"model {admission.model!r} failed to start: {failure}"
                await out.error(Detached(*start_failure(failure), message))
                return
            raw_query: bytes = scope.get("query_string", b"")
            url = upstream_url(
                ticket.ready.result(), upstream_path or scope["path"], raw_query.decode("latin-1")
            )
            method = str(scope.get("method", "GET"))
            await self.forwarder.forward(
                method, url, body, headers, ticket, out, disconnected=disconnected
            )
        finally:
            disconnected.cancel()

    async def _send_progress(
        self, send: Send, ticket: Ticket, admission: Admission, waiting: list[asyncio.Future[Any]]
    ) -> Send:
        """Start an SSE response and send a progress chunk (as `reasoning_content`,
        like llama-swap) every second until the request may run. Returns a `send`
        for the rest of the response that drops the upstream's own start message."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    *ticket_headers(
                        ticket, admission.requested_priority, admission.priority_unreadable
                    ),
                ],
            }
        )
        while not any(f.done() for f in waiting):
            text = await self._progress_text(ticket.request_id, admission.model)
            await send(
                {"type": "http.response.body", "body": _sse_progress(text), "more_body": True}
            )
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)

        async def rest(message: Message) -> None:
            if message["type"] != "http.response.start":
                await send(message)

        return rest

    async def _progress_text(self, request_id: str, model: str) -> str:
        ahead = await self.scheduler.ahead(request_id)
        if ahead is not None:
            return f"gpulane: waiting in the queue, {ahead} ahead of this request\n"
        return f"gpulane: loading model {model}\n"


def _with_service_tier(asked: int | None, doc: dict[str, Any]) -> int | None:
    """What the request asks for once its body is read: the header wins, else
    the OpenAI `service_tier`. A tier gpulane does not know is refused even when
    the header wins, so a typo never passes unnoticed."""
    try:
        tier = tier_priority(doc.get("service_tier"))
    except ValueError as exc:
        raise BadRequest(400, str(exc), "invalid_service_tier", "service_tier") from None
    return asked if asked is not None else tier


def _query(scope: Scope) -> str:
    return bytes(scope.get("query_string", b"")).decode("latin-1")


def _headers(scope: Scope) -> dict[str, str]:
    # latin-1 maps bytes to str one to one, so the original bytes come back
    # exactly when forwarding (`outgoing_headers`), UTF-8 or not.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _sse_progress(text: str) -> bytes:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"reasoning_content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
