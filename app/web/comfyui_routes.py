"""ComfyUI behind gpulane: `/comfyui/...` (llama-swap's routes, for its
`comfyui_auto` model) and `/upstream/MODEL/...` for a model with `kind: comfyui`.

`POST .../prompt` is a job in gpulane's queue like any other (priority header,
caller, fair share, chains, admission limits, explain): gpulane gives the
prompt its id (the client's `prompt_id` if it sent one), answers at once in
ComfyUI's shape (`prompt_id`, `number`, `node_errors`) once the job is on disk,
and sends it when its turn comes, loading ComfyUI if needed. The render then
holds its model until ComfyUI's history says it ended (app/jobs/held.py,
app/web/comfyui.py), and that entry is kept with the job, so `GET
.../history/ID` answers from gpulane after ComfyUI was swapped out.

What gpulane answers itself, from its queue and what it keeps: `GET
/history/ID` (`{}` while the prompt waits or runs), `GET /history`, `GET
/queue` (`queue_running`, `queue_pending`), `GET /prompt`, and the cancels
(`POST /interrupt`, `POST /queue {delete|clear}`). Every other path goes to
ComfyUI while it runs, without the queue (nothing there uses the GPU), and is
409 naming what would load it when it does not: nothing but a prompt loads or
swaps anything (as llama-swap's `ignorePaths`). With apiKeys a user key sees and
cancels only its own prompts, and fetches through `/view` only their images.
`/ws` is gpulane's own socket, open whether ComfyUI runs or not, where each
caller hears its own prompts' messages (app/web/comfyui_sockets.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import mimetypes
import re
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
from litestar import asgi
from litestar.enums import ScopeType
from litestar.handlers import BaseRouteHandler
from litestar.types import Receive, Scope, Send

from app.config import Config
from app.config.callers import CREDENTIAL_HEADERS
from app.core.priority import HEADER, grant, read_priority, unreadable_priority
from app.jobs.durable import JobRequest, Jobs
from app.jobs.held import HeldRuns
from app.jobs.job_view import seen_by
from app.runtime.api import Admission
from app.runtime.scheduler import Scheduler
from app.web.access import identity, is_admin, only_caller
from app.web.auth import identify
from app.web.chain_headers import read_chain
from app.web.comfyui import ComfyProbe, failed_entry
from app.web.comfyui_sockets import ComfySockets
from app.web.errors import (
    send_error,
    send_json,
    send_websocket_error,
)
from app.web.jobs import accept_or_answer
from app.web.refusals import Asked, record
from app.web.request_body import BadRequest, max_wait_ns, read_body
from app.web.websocket_proxy import WebsocketProxy

DOOR = "comfyui"
ENDPOINT = "/comfyui/prompt"
"""What the log records a prompt's requests as."""
"""The jobs' door: their sender is the held runner with ComfyUI's probe."""
PROMPT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
USER_PATHS = re.compile(
    r"^/($|index\.html$|object_info|system_stats$|embeddings$|models|extensions$|features$|"
    r"upload/(image|mask)$|assets/|scripts/|extensions/|favicon)"
)
"""What a user key may reach on ComfyUI itself: its pages, what it knows, uploads."""
_CONNECTION = frozenset({"host", "connection", "content-length", "transfer-encoding"})


class ComfyDoor:
    def __init__(self, config: Config, scheduler: Scheduler, jobs: Jobs) -> None:
        self.config = config
        self.scheduler = scheduler
        self.jobs = jobs
        self._numbers = itertools.count()
        self.numbers: dict[str, int] = {}
        """Prompt id -> the `number` it was answered with (this process's)."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
        self.hub = ComfySockets(scheduler, self.model)
        """`/comfyui/ws`: gpulane's own socket, fed by the probe (comfyui_sockets.py)."""
        self.probe = ComfyProbe(relay=self.hub)
        self.sockets = WebsocketProxy(config, scheduler)

    async def aclose(self) -> None:
        await self.hub.aclose()
        await self.client.aclose()
        await self.probe.aclose()

    def model(self) -> str | None:
        """The model `/comfyui/...` reaches: `comfyui_auto`, else the one model
        with `kind: comfyui`."""
        if self.config.resolve_model("comfyui_auto") is not None:
            return self.config.resolve_model("comfyui_auto")
        kinds = [m.id for m in self.config.models.values() if m.kind == DOOR and m.peer is None]
        return kinds[0] if len(kinds) == 1 else None

    async def mounted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`/comfyui` and `/comfyui/{path...}`."""
        model = self.model()
        if model is None:
            kinds = [m.id for m in self.config.models.values() if m.kind == DOOR]
            why = (
                f"several models have kind comfyui ({', '.join(kinds)}): "
                "reach each at /upstream/MODEL/"
                if kinds
                else "no model is ComfyUI: name one comfyui_auto or give it `kind: comfyui`"
            )
            if scope["type"] == ScopeType.WEBSOCKET:
                await receive()  # websocket.connect: refused before it opens
                await send_websocket_error(
                    scope, send, 404, f"/comfyui: {why}", code="model_not_found"
                )
            else:
                await send_error(send, 404, f"/comfyui: {why}", code="model_not_found")
            return
        raw = scope.get("raw_path") or scope["path"].encode()
        path = raw.decode("latin-1").split("?", 1)[0].removeprefix("/comfyui") or "/"
        if scope["type"] == ScopeType.WEBSOCKET and path == "/ws":
            # gpulane's own: any key that may post prompts hears its own there.
            await self.hub.serve(scope, receive, send)
            return
        if scope["type"] == ScopeType.WEBSOCKET:
            # Any other socket is ComfyUI's own, passed through, never a job
            # (app/web/websocket_proxy.py). Admin only: ComfyUI gives a client
            # id's messages to whoever connects with it last.
            await self.sockets.serve(
                scope, receive, send, model, path, "/comfyui" + path, admin_only=True
            )
            return
        await self.handle(scope, receive, send, model, path)

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, model: str, path: str
    ) -> None:
        method = str(scope.get("method", "GET"))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        only = only_caller(identity(scope))
        try:
            if method == "POST" and path == "/prompt":
                await self._prompt(scope, receive, send, model, path, headers)
            elif method == "GET" and path.startswith("/history/"):
                await self._history_one(send, only, path.removeprefix("/history/"))
            elif method == "GET" and path == "/history":
                await self._history(send, only, scope)
            elif method == "GET" and path == "/queue":
                running, pending = self._queue(model, only)
                await _json(send, {"queue_running": running, "queue_pending": pending})
            elif method == "GET" and path == "/prompt":
                running, pending = self._queue(model, only)
                remaining = len(running) + len(pending)
                await _json(send, {"exec_info": {"queue_remaining": remaining}})
            elif method == "POST" and path in ("/interrupt", "/queue", "/history"):
                doc = _doc(await read_body(receive, self.config.max_body_bytes))
                await self._cancel(send, model, only, path, doc)
            else:
                await self._pass(scope, receive, send, model, path, headers)
        except BadRequest as exc:
            await send_error(send, exc.status, exc.message, code=exc.code)
        except ConnectionError:
            return

    # -- prompts --------------------------------------------------------------

    async def _prompt(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        model: str,
        path: str,
        headers: dict[str, str],
    ) -> None:
        asked = read_priority(headers.get(HEADER.lower()))
        # What is known of the request when it is refused, for its record.
        refused = Asked(ENDPOINT, model, grant(asked))
        try:
            who = identify(scope, headers)
            refused = refused._replace(priority=who.grant(asked), caller=who.caller)
            max_wait = max_wait_ns(headers)
            chain, chain_length = read_chain(headers)
            body = await read_body(receive, self.config.max_body_bytes)
            doc = _doc(body)
        except BadRequest as exc:
            recorded = record(self.scheduler, refused, exc.status, exc.message)
            await send_error(send, exc.status, exc.message, code=exc.code, headers=recorded)
            return
        given = doc.get("prompt_id")
        prompt_id = str(uuid.uuid4()) if given in (None, "") else str(given)
        wrong = None
        if "prompt" not in doc:
            wrong = ("no_prompt", "No prompt provided")
        elif not PROMPT_ID.match(prompt_id):
            message = f"prompt_id {prompt_id[:64]!r} is not 1-128 letters, digits, _ . : -"
            wrong = ("invalid_prompt_id", message)
        elif await self.jobs.view(prompt_id, place=False) is not None:
            wrong = ("prompt_id_in_use", f"prompt_id {prompt_id} is already used")
        if wrong is not None:
            recorded = record(self.scheduler, refused, 400, wrong[1])
            await _comfy_error(send, *wrong, headers=recorded)
            return
        doc["prompt_id"] = prompt_id
        admission = Admission(
            model=model,
            model_requested=model,
            endpoint=ENDPOINT,
            priority=who.grant(asked),
            requested_priority=asked,
            priority_unreadable=unreadable_priority(headers.get(HEADER.lower())),
            caller=who.caller,
            max_wait_ns=max_wait,
            chain=chain,
            chain_length=chain_length,
        )
        job = JobRequest(
            method="POST",
            path="/prompt",
            query="",
            body=json.dumps(doc).encode(),
            headers=headers,
            door=DOOR,
            request_id=prompt_id,
        )
        if await accept_or_answer(self.jobs, send, admission, job) is None:
            return
        number = self.numbers[prompt_id] = next(self._numbers)
        extra = [(b"x-request-id", prompt_id.encode())]
        answer = {"prompt_id": prompt_id, "number": number, "node_errors": {}}
        await send_json(send, 200, json.dumps(answer).encode(), extra)

    async def _history_one(self, send: Send, only: str | None, prompt_id: str) -> None:
        view = await self.jobs.view_for(only, prompt_id, place=False)
        if view is None or view.get("door") != DOOR:
            await _json(send, {})  # as ComfyUI answers for an id it does not know
            return
        await _json(send, _entry(view))

    async def _history(self, send: Send, only: str | None, scope: Scope) -> None:
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        wanted = re.search(r"(?:^|&)max_items=(\d+)", query)
        limit = min(int(wanted.group(1)), 1000) if wanted else 1000
        views = await self.jobs.listing(None, 1000, only)
        out: dict[str, Any] = {}
        # Oldest first, as ComfyUI keeps its history; the newest `max_items`.
        for view in reversed([v for v in views if v.get("door") == DOOR]):
            out |= _entry(view)
        await _json(send, dict(list(out.items())[-limit:]) if limit else {})

    def _queue(self, model: str, only: str | None) -> tuple[list[Any], list[Any]]:
        state = self.scheduler.live().state
        running: list[Any] = []
        pending: list[Any] = []
        for rid, request in state.requests.items():
            if request.model != model or not seen_by(only, request.caller):
                continue
            item = [self.numbers.get(rid, 0), rid, {}, {}, []]
            (running if request.running else pending).append(item)
        return running, pending

    async def _cancel(
        self, send: Send, model: str, only: str | None, path: str, doc: dict[str, Any]
    ) -> None:
        """`/interrupt` (the running prompt, or the one named), `/queue {delete,
        clear}`: cancelled in gpulane, which interrupts ComfyUI if it runs.
        `POST /history` changes nothing: gpulane keeps each prompt's entry until
        jobs.resultRetention."""
        state = self.scheduler.live().state
        mine = {
            rid: r
            for rid, r in state.requests.items()
            if r.model == model and seen_by(only, r.caller)
        }
        if path == "/interrupt":
            named = doc.get("prompt_id")
            chosen = [named] if named else [rid for rid, r in mine.items() if r.running]
        elif path == "/queue":
            chosen = [str(x) for x in doc.get("delete") or []]
            if doc.get("clear"):
                chosen += [rid for rid, r in mine.items() if not r.running]
        else:
            chosen = []
        for rid in chosen:
            if rid in mine:
                self.scheduler.cancel_any(rid)
        await self.scheduler.recorded(timeout=5.0)
        await send_json(send, 200, b"{}")

    # -- everything else ------------------------------------------------------

    async def _pass(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        model: str,
        path: str,
        headers: dict[str, str],
    ) -> None:
        """ComfyUI's own answer while it runs (or sleeps), outside the queue; 409 when
        it does not."""
        who = identity(scope)
        method = str(scope.get("method", "GET"))
        allowed = is_admin(who) or USER_PATHS.match(path)
        if not allowed and not (path == "/view" and await self._owns_image(who.caller, scope)):
            message = f"{method} /comfyui{path} needs an admin API key"
            await send_error(send, 403, message, code="admin_key_required")
            return
        # A sleeping ComfyUI (`sleep: comfyui`) still answers: nothing here loads its models.
        if self.scheduler.model_status(model).state not in ("ready", "sleeping"):
            if path == "/view" and self.config.models[model].output_dir is not None:
                await self._view_kept(scope, send, model, only_caller(who))
                return
            message = (
                f"ComfyUI ({model!r}) is not loaded: {path} is answered only while it runs, "
                f"and only a POST /comfyui/prompt loads it (finished prompts: GET /comfyui/history)"
            )
            await send_error(send, 409, message, code="model_not_loaded")
            return
        body = await read_body(receive, self.config.max_body_bytes)
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        url = self.config.models[model].proxy + path + (f"?{query}" if query else "")
        # The client's credentials are gpulane's unless the model passes them.
        passed = self.config.models[model].pass_credentials
        sent = {
            k: v
            for k, v in headers.items()
            if k not in _CONNECTION and (k not in CREDENTIAL_HEADERS or k in passed)
        }
        try:
            r = await self.client.request(method, url, content=body, headers=sent)
        except httpx.HTTPError as exc:
            message = f"ComfyUI ({model!r}) did not answer: {type(exc).__name__}: {exc}"
            await send_error(send, 502, message, code="upstream_error")
            return
        kept = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in r.headers.items()
            if k.lower() not in _CONNECTION and k.lower() != "content-encoding"
        ]
        kept.append((b"content-length", str(len(r.content)).encode()))
        await send({"type": "http.response.start", "status": r.status_code, "headers": kept})
        await send({"type": "http.response.body", "body": r.content, "more_body": False})

    async def _owns_image(self, caller: str | None, scope: Scope) -> bool:
        """Whether `filename` in the query names an image of one of the caller's prompts."""
        wanted = _image_asked(scope)
        return caller is not None and wanted is not None and await self._kept(wanted, caller)

    async def _kept(self, image: tuple[str, str], only: str | None) -> bool:
        """Whether (subfolder, filename) is an output of a finished prompt `only`
        (None: anyone) may see."""
        for view in await self.jobs.listing("completed", 1000, only):
            if view.get("door") != DOOR:
                continue
            for entry in _entry(view).values():
                for node in (entry.get("outputs") or {}).values():
                    for item in node.get("images", []) if isinstance(node, dict) else []:
                        if (item.get("subfolder", ""), item.get("filename")) == image:
                            return True
        return False

    async def _view_kept(self, scope: Scope, send: Send, model: str, only: str | None) -> None:
        """`/view` of a finished prompt's image while ComfyUI is not loaded: from
        its `outputDir`, for an image a kept history entry names."""
        image = _image_asked(scope)
        folder = Path(self.config.models[model].output_dir or ".").resolve()
        path = None if image is None else (folder / image[0] / image[1]).resolve()
        named = image is not None and await self._kept(image, only)
        if path is None or not named or not path.is_relative_to(folder) or not path.is_file():
            what = "no image" if image is None else f"{image[1]!r}"
            message = (
                f"{what} is not an output of a finished prompt kept by gpulane "
                f"(ComfyUI {model!r} is not loaded; its outputDir is served for those)"
            )
            await send_error(send, 404, message, code="not_found")
            return
        body = await asyncio.to_thread(path.read_bytes)
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        head = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _image_asked(scope: Scope) -> tuple[str, str] | None:
    """(subfolder, filename) of a `/view` query for an output image; None when it
    names none or another type (input, temp: never kept)."""
    query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
    name = query.get("filename", [""])[0]
    if not name or query.get("type", ["output"])[0] != "output":
        return None
    return query.get("subfolder", [""])[0], name


def _entry(view: dict[str, Any]) -> dict[str, Any]:
    """A prompt's history as ComfyUI answers it: `{}` while it waits or runs, its
    entry once it ended (kept by gpulane; for one that ended in gpulane, built)."""
    prompt_id = view["id"]
    status = view.get("status")
    if status in ("queued", "running"):
        return {}
    body = (view.get("result") or {}).get("body")
    if isinstance(body, dict) and prompt_id in body:
        return body
    event = "execution_interrupted" if status == "cancelled" else "execution_error"
    data = {"prompt_id": prompt_id, "exception_message": view.get("error") or status}
    built: dict[str, Any] = json.loads(failed_entry(prompt_id, event, data))
    return built


def _doc(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        raise BadRequest(400, "the body is not JSON", "invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "the body is not a JSON object", "invalid_json")
    return doc


async def _json(send: Send, doc: Any) -> None:
    await send_json(send, 200, json.dumps(doc).encode())


async def _comfy_error(
    send: Send, kind: str, message: str, *, headers: list[tuple[bytes, bytes]]
) -> None:
    """A 400 in ComfyUI's own shape, which its clients read (`headers`: its X-Request-Id)."""
    error = {"type": kind, "message": message, "details": message, "extra_info": {}}
    doc = {"error": error, "node_errors": {}}
    await send_json(send, 400, json.dumps(doc).encode(), headers)


def open_renders(config: Config, scheduler: Scheduler, jobs: Jobs) -> ComfyDoor:
    """The ComfyUI door, its prompts sent by the held runner with ComfyUI's probe."""
    door = ComfyDoor(config, scheduler, jobs)
    jobs.senders[DOOR] = HeldRuns(scheduler, {DOOR: door.probe})
    return door


def comfyui_routes(door: ComfyDoor) -> list[BaseRouteHandler]:
    """`/comfyui` and everything under it, any method."""

    async def comfyui(scope: Scope, receive: Receive, send: Send) -> None:
        await door.mounted(scope, receive, send)

    return [asgi(path="/comfyui", is_mount=True, copy_scope=False)(comfyui)]
