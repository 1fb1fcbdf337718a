"""gpulane's own ComfyUI websocket: `/comfyui/ws?clientId=X`.

ComfyUI sends a prompt's messages (`execution_start`, `executing`, `progress`,
`executed`, `execution_success|error|interrupted`, binary previews) only to the
socket of the prompt's `client_id`, and gives an id to whoever connected with
it last. Behind gpulane that socket is gpulane's, not ComfyUI's: the held
runner sends each prompt to ComfyUI under its probe's own id
(app/web/comfyui.py), the probe hands every message of the prompt here
(`route`), and this hub sends it to the client sockets registered under (the
prompt's caller, the `client_id` the client posted). So:

- any key that may post prompts may open it (a user key too): a caller hears
  only its own prompts, even where two callers use one clientId;
- it opens whether ComfyUI runs or not, and outlives swaps of the ComfyUI
  process: a prompt waiting in gpulane's queue, sent later to a freshly loaded
  ComfyUI, is still heard on the socket opened before;
- on open it sends what ComfyUI sends (`status` with `exec_info.
  queue_remaining` and `sid`, a new id when none was given); then `status`
  (without `sid`, as ComfyUI's `queue_updated`) whenever that number changes:
  the prompts of the ComfyUI model the key may see (all of them for an admin
  key or without apiKeys, its own for a user key), waiting in gpulane's queue
  or running, as `GET /comfyui/prompt` counts them. The state's version is
  looked at every `STATUS_CHECK_S` while sockets are open.
- A prompt posted without `client_id` reaches its caller's sockets as ComfyUI
  broadcasts such a prompt: its `progress`, previews and
  `execution_interrupted` only.

As in ComfyUI the newest socket with a (caller, clientId) takes it over: an
older one stays open and hears nothing more. Bounds: `SOCKETS_PER_CALLER` open
sockets (one more is refused with 429 before it opens); per socket, messages
waiting to be written are bounded (`BEHIND_MESSAGES`, `BEHIND_BYTES`): a
client too slow to read them loses previews first (`PREVIEW_BEHIND`), then is
closed with 1013 and a reason naming what to do, so a slow socket never holds
up the probe or another socket. What the client sends is read and ignored (as
ComfyUI does), within uvicorn's message size limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from urllib.parse import parse_qs

from litestar.types import Receive, Scope, Send

from app.jobs.job_view import seen_by
from app.runtime.scheduler import Scheduler
from app.web.access import only_caller
from app.web.auth import identify
from app.web.errors import send_websocket_error
from app.web.request_body import BadRequest

log = logging.getLogger("gpulane.proxy")

SOCKETS_PER_CALLER = 32
"""Open `/comfyui/ws` sockets per caller (anonymous callers are one caller)."""
BEHIND_MESSAGES = 1000
BEHIND_BYTES = 64 * 1024 * 1024
"""What may wait to be written to one socket; past either it is closed (1013)."""
PREVIEW_BEHIND = 8
"""Messages waiting past which a binary preview is dropped, not queued: the next
one supersedes it."""
STATUS_CHECK_S = 0.25
"""Between two looks at whether a socket's `queue_remaining` changed."""
CLIENT_ID_CHARS = 256
BROADCAST = frozenset({"progress", "preview", "execution_interrupted"})
"""What ComfyUI sends every socket of a prompt that names no `client_id`."""


class _Client:
    """One open socket: what waits to be written to it, and why it closes."""

    def __init__(self, caller: str | None, sid: str, only: str | None) -> None:
        self.caller = caller
        self.sid = sid
        self.only = only
        """Whose prompts its `queue_remaining` counts (None: everyone's)."""
        self.remaining: int | None = None
        """The `queue_remaining` it was last told."""
        self.waiting: collections.deque[str | bytes] = collections.deque()
        self.waiting_bytes = 0
        self.dropped = 0
        self.closing: tuple[int, str] | None = None
        self.wake = asyncio.Event()

    def put(self, message: str | bytes, *, preview: bool = False) -> None:
        """Queue a message for the writer; never waits."""
        if self.closing is not None:
            return
        size = len(message)
        if preview and self.waiting and len(self.waiting) >= PREVIEW_BEHIND:
            self.dropped += 1
            return
        if len(self.waiting) >= BEHIND_MESSAGES or self.waiting_bytes + size > BEHIND_BYTES:
            behind = f"{len(self.waiting)} messages, {self.waiting_bytes} bytes"
            self.close(1013, f"gpulane: this socket fell behind ({behind}); reconnect")
            return
        self.waiting.append(message)
        self.waiting_bytes += size
        self.wake.set()

    def close(self, code: int, reason: str) -> None:
        self.closing = (code, reason.encode()[:123].decode(errors="ignore"))
        self.waiting.clear()
        self.waiting_bytes = 0
        self.wake.set()

    async def write(self, send: Send) -> None:
        """Write what is queued, in order, until closed."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.waiting:
                message = self.waiting.popleft()
                self.waiting_bytes -= len(message)
                if isinstance(message, bytes):
                    await send({"type": "websocket.send", "bytes": message, "text": None})
                else:
                    await send({"type": "websocket.send", "bytes": None, "text": message})
            if self.closing is not None:
                code, reason = self.closing
                await send({"type": "websocket.close", "code": code, "reason": reason})
                return


class ComfySockets:
    """The hub: client sockets by (caller, clientId), and what the probe relays."""

    def __init__(self, scheduler: Scheduler, model: Callable[[], str | None]) -> None:
        self.scheduler = scheduler
        self.model = model
        """The ComfyUI model of `/comfyui/...` (its queue is what `status` counts)."""
        self._current: dict[tuple[str | None, str], _Client] = {}
        """(caller, clientId) -> the newest socket with it."""
        self._open: set[_Client] = set()
        self._statuses: asyncio.Task[None] | None = None

    def open_count(self, caller: str | None) -> int:
        return sum(1 for c in self._open if c.caller == caller)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One `/comfyui/ws` socket, from its `websocket.connect` to its end."""
        if (await receive())["type"] != "websocket.connect":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            who = identify(scope, headers)
        except BadRequest as exc:
            await send_websocket_error(scope, send, exc.status, exc.message, code=exc.code)
            return
        query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        sid = query.get("clientId", [""])[0] or uuid.uuid4().hex
        if len(sid) > CLIENT_ID_CHARS:
            message = f"clientId is {len(sid)} characters; at most {CLIENT_ID_CHARS} are allowed"
            await send_websocket_error(scope, send, 400, message, code="invalid_client_id")
            return
        if self.open_count(who.caller) >= SOCKETS_PER_CALLER:
            message = (
                f"this caller has {SOCKETS_PER_CALLER} /comfyui/ws sockets open, "
                f"the most allowed: close one first"
            )
            await send_websocket_error(scope, send, 429, message, code="too_many_sockets")
            return
        await send({"type": "websocket.accept"})  # type: ignore[typeddict-item]
        client = _Client(who.caller, sid, only_caller(who))
        self._current[(who.caller, sid)] = client  # the newest takes the id, as in ComfyUI
        self._open.add(client)
        client.remaining = self._remaining(client.only)
        status = {"status": {"exec_info": {"queue_remaining": client.remaining}}, "sid": sid}
        client.put(json.dumps({"type": "status", "data": status}))
        if self._statuses is None or self._statuses.done():
            self._statuses = asyncio.ensure_future(self._watch_queue())
        reading = asyncio.ensure_future(_read_until_closed(receive))
        writing = asyncio.ensure_future(client.write(send))
        try:
            await asyncio.wait({reading, writing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, writing):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._open.discard(client)
            if self._current.get((who.caller, sid)) is client:
                del self._current[(who.caller, sid)]
            if client.dropped:
                log.info("/comfyui/ws %s: a slow client missed %d previews", sid, client.dropped)

    def route(self, prompt_id: str, client_id: str | None) -> Callable[[str, str | bytes], None]:
        """Where the messages of `prompt_id` go: the sockets of its caller (as it
        runs now, when it is submitted) and `client_id`. Each is looked up as it
        comes, so a socket opened or reopened mid-render hears the rest."""
        request = self.scheduler.state.requests.get(prompt_id)
        if request is None:
            return _nowhere
        caller = request.caller

        def deliver(kind: str, message: str | bytes) -> None:
            """`kind`: the message's type, `preview` for a binary one."""
            if client_id is not None:
                found = self._current.get((caller, client_id))
                targets = [] if found is None else [found]
            elif kind in BROADCAST:
                targets = [c for (who, _), c in self._current.items() if who == caller]
            else:
                targets = []
            for client in targets:
                client.put(message, preview=kind == "preview")

        return deliver

    async def aclose(self) -> None:
        for client in list(self._open):
            client.close(1001, "gpulane is shutting down")
        if self._statuses is not None:
            self._statuses.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._statuses

    def _remaining(self, only: str | None) -> int:
        """Requests of the ComfyUI model that `only` may see, waiting or running."""
        model = self.model()
        requests = self.scheduler.state.requests.values()
        return sum(1 for r in requests if r.model == model and seen_by(only, r.caller))

    async def _watch_queue(self) -> None:
        """Tell each socket its `queue_remaining` when it changes, while any is open."""
        seen = self.scheduler.version
        while self._open:
            await asyncio.sleep(STATUS_CHECK_S)
            if self.scheduler.version == seen:
                continue
            seen = self.scheduler.version
            counts: dict[str | None, int] = {}
            for client in list(self._current.values()):
                if client.only not in counts:
                    counts[client.only] = self._remaining(client.only)
                if counts[client.only] != client.remaining:
                    client.remaining = counts[client.only]
                    status = {"status": {"exec_info": {"queue_remaining": client.remaining}}}
                    client.put(json.dumps({"type": "status", "data": status}))


def _nowhere(kind: str, message: str | bytes) -> None:
    """A prompt no longer in the queue when it was sent: its messages go nowhere."""


async def _read_until_closed(receive: Receive) -> None:
    """Read what the client sends (ComfyUI ignores it too) until it closes."""
    while (await receive())["type"] != "websocket.disconnect":
        pass
