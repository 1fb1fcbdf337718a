"""ComfyUI's probe: how gpulane sends a prompt and learns that its render ended.

ComfyUI (v0.3.64, its `server.py` and `execution.py`) answers `POST /prompt`
at once and renders in a worker thread; `GET /history/{prompt_id}` is `{}`
until the prompt ends, then holds its entry, whose `status` says how it ended
(`status_str` success or error; the messages name an `execution_error` or an
`execution_interrupted`). The probe polls that entry, and checks now and then
that the prompt is still in ComfyUI's queue, so a prompt ComfyUI dropped (its
queue cleared, the server restarted) ends instead of holding the model forever.

What else happens to a render comes from ComfyUI's websocket. ComfyUI sends a
prompt's messages (`execution_start`, `executing`, `progress` `{"value", "max",
"prompt_id", "node"}`, `executed`, its end, binary previews) only to the socket
of the prompt's `client_id` (`main.py` `hijack_progress`, `server.py`
`send_json`), and gives an id to the newest connection with it. So the probe
opens a socket of its own per render (`/ws?clientId=gpulane-...`), waits for
ComfyUI's `status` on it (the id is registered then), and only then submits
the prompt, with `client_id` rewritten to its own id in the body sent upstream
(the stored job keeps the client's). It keeps the last `progress`, and hands
every message of the prompt to the relay (app/web/comfyui_sockets.py), which
sends it on to the client's own socket at gpulane. ComfyUI's `status` (its
queue, its sid) is not handed on: gpulane's queue is the client's. The prompt
id in the messages is the client's: gpulane gives ComfyUI the id it answered.
Once the history has the end, the probe waits at most `LINGER_S` for the
prompt's last message (`executing` with no node, which ComfyUI sends after
writing the history). The end is still learnt from the history: a socket that
fails costs the progress and the messages, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.version import version as websockets_version

from app.jobs.held import ProbeLost, Verdict

POLL_S = 0.2
"""Between two reads of a running prompt's history entry."""
QUEUE_EVERY = 25
"""Polls between two checks that the prompt is still queued or running."""
LOST_AFTER = 5
"""Failed reads in a row after which ComfyUI is taken to be gone."""
WS_MAX_BYTES = 64 * 1024 * 1024
"""ComfyUI's socket also carries preview images."""
WS_OPEN_S = 5.0
"""How long opening the probe's socket (up to ComfyUI's first `status`) may
delay a prompt's submission; past it the prompt goes without."""
LINGER_S = 2.0
"""How long a prompt's last messages are waited for once its history says it ended."""

log = logging.getLogger("gpulane.jobs")


Deliver = Callable[[str, str | bytes], None]
"""Hands one message of a prompt on: (its type, `preview` for a binary one; the message)."""


class Relay(Protocol):
    """Where a prompt's messages go on to (app/web/comfyui_sockets.py)."""

    def route(self, prompt_id: str, client_id: str | None) -> Deliver:
        """Where the messages of `prompt_id` go, decided when it is submitted
        (it runs then); `client_id`: the one its client posted (None: none)."""
        ...


class _Watch:
    """The probe's socket for one render."""

    def __init__(self) -> None:
        self.task: asyncio.Future[None] | None = None
        self.ended = asyncio.Event()
        """The prompt's last message came, or the socket is gone."""


class ComfyProbe:
    """`app.jobs.held.Probe` for ComfyUI."""

    def __init__(self, poll_s: float = POLL_S, relay: Relay | None = None) -> None:
        self.poll_s = poll_s
        self.relay = relay
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0))
        self._progress: dict[str, tuple[int, int]] = {}
        self._watches: dict[str, _Watch] = {}

    async def aclose(self) -> None:
        await self.client.aclose()

    async def finished(self, base_url: str, job_id: str) -> Verdict | None:
        try:
            entry = await self._entry(base_url, job_id)
        except httpx.HTTPError:
            return None
        return None if entry is None else verdict_of(job_id, entry)

    async def submit(self, base_url: str, job: dict[str, Any], body: bytes) -> Verdict | None:
        headers = {"content-type": "application/json"}
        job_id = _prompt_id(body)
        doc = _json(body)
        asked = doc.get("client_id") if isinstance(doc, dict) else None
        client_id = asked if isinstance(asked, str) and asked else None
        try:
            own = await self._watch(base_url, job_id, client_id)
            if own is not None and isinstance(doc, dict):
                body = json.dumps(doc | {"client_id": own}).encode()
            try:
                r = await self.client.post(base_url + job["path"], content=body, headers=headers)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                raise ProbeLost(f"ComfyUI did not take the prompt: {why}") from None
        except BaseException:
            await self._unwatch(job_id)
            raise
        if r.status_code == 200:
            return None
        await self._unwatch(job_id)
        answer = _json(r.content)
        error = answer.get("error") if isinstance(answer, dict) else None
        said = error.get("message") if isinstance(error, dict) else None
        message = f"ComfyUI refused the prompt ({r.status_code}): {said or r.text[:200]}"
        data: dict[str, Any] = {"prompt_id": job_id, "exception_message": message}
        if isinstance(answer, dict):
            data |= {"error": answer.get("error"), "node_errors": answer.get("node_errors", {})}
        entry = failed_entry(job_id, "execution_error", data)
        return Verdict(ok=False, status=r.status_code, error=message, result=entry)

    def progress(self, job_id: str) -> tuple[int, int] | None:
        return self._progress.get(job_id)

    async def wait(self, base_url: str, job_id: str) -> Verdict:
        try:
            verdict = await self._wait(base_url, job_id)
        except asyncio.CancelledError:
            # Taken away: `interrupt` comes next, and lets the socket go once
            # ComfyUI said how the prompt ended (its `execution_interrupted`).
            self._progress.pop(job_id, None)
            raise
        except BaseException:
            await self._unwatch(job_id)
            self._progress.pop(job_id, None)
            raise
        await self._linger(job_id)
        self._progress.pop(job_id, None)
        return verdict

    async def _linger(self, job_id: str) -> None:
        """Let the prompt's socket go once its last message came, or after LINGER_S."""
        watch = self._watches.get(job_id)
        try:
            if watch is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.ended.wait(), LINGER_S)
        finally:
            await self._unwatch(job_id)

    async def _watch(self, base_url: str, job_id: str, client_id: str | None) -> str | None:
        """Open the probe's socket for `job_id` and start reading it: the id it
        is registered under at ComfyUI, or None when it did not open."""
        await self._unwatch(job_id)  # a job sent again: its last socket is done with
        own = f"gpulane-{uuid.uuid4().hex}"
        url = "ws" + base_url.removeprefix("http") + f"/ws?clientId={own}"
        # A short close: the render's end waits for this socket to be let go.
        options: dict[str, Any] = {
            "max_size": WS_MAX_BYTES,
            "open_timeout": WS_OPEN_S,
            "close_timeout": 1.0,
        }
        if int(websockets_version.split(".")[0]) >= 15:
            options["proxy"] = None  # a local server: no environment proxy
        socket: ClientConnection | None = None
        try:
            async with asyncio.timeout(WS_OPEN_S):
                socket = await connect(url, **options)
                # ComfyUI registers the id before it sends `status`: from now on
                # every message of a prompt sent with it comes here.
                await socket.recv()
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            log.info("job %s: no messages from ComfyUI's websocket: %s", job_id, exc)
            if socket is not None:
                await socket.close()
            return None
        except BaseException:
            if socket is not None:
                socket.transport.abort()  # cancelled meanwhile: let it go at once
            raise
        deliver = None if self.relay is None else self.relay.route(job_id, client_id)
        watch = self._watches[job_id] = _Watch()
        watch.task = asyncio.ensure_future(self._listen(socket, job_id, deliver, watch))
        return own

    async def _unwatch(self, job_id: str) -> None:
        watch = self._watches.pop(job_id, None)
        if watch is not None and watch.task is not None:
            watch.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch.task

    async def _listen(
        self, socket: ClientConnection, job_id: str, deliver: Deliver | None, watch: _Watch
    ) -> None:
        """Keep the render's last `progress` and relay its messages until cancelled."""
        try:
            async with socket:
                async for message in socket:
                    if isinstance(message, bytes):
                        if deliver is not None:  # a preview: no prompt id, ours
                            deliver("preview", message)
                        continue
                    doc = _json(message.encode())
                    kind = doc.get("type") if isinstance(doc, dict) else None
                    data = doc.get("data") if isinstance(doc, dict) else None
                    about = data.get("prompt_id") if isinstance(data, dict) else None
                    if kind == "status" or (about is not None and about != job_id):
                        continue  # ComfyUI's own queue; another prompt's broadcast
                    seen = _progress_of(doc, job_id)
                    if seen is not None:
                        self._progress[job_id] = seen
                    if deliver is not None and isinstance(kind, str):
                        deliver(kind, message)
                    if kind == "executing" and isinstance(data, dict) and data.get("node") is None:
                        watch.ended.set()  # ComfyUI's last message of a prompt
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            log.info("job %s: ComfyUI's websocket failed: %s", job_id, exc)
        except Exception:  # messages are a nicety: they never fail the render
            log.exception("job %s: reading ComfyUI's websocket failed", job_id)
        finally:
            watch.ended.set()
            if self._watches.get(job_id) is watch:  # gone by itself (ComfyUI stopped)
                del self._watches[job_id]

    async def _wait(self, base_url: str, job_id: str) -> Verdict:
        misses = 0
        polls = 0
        while True:
            await asyncio.sleep(self.poll_s)
            polls += 1
            try:
                entry = await self._entry(base_url, job_id)
                look = entry is None and polls % QUEUE_EVERY == 0
                if look and not await self._queued(base_url, job_id):
                    entry = await self._entry(base_url, job_id)  # it may just have ended
                    if entry is None:
                        raise ProbeLost(
                            f"ComfyUI dropped prompt {job_id}: it is neither queued, "
                            "running nor in its history"
                        )
                misses = 0
            except httpx.HTTPError as exc:
                misses += 1
                if misses >= LOST_AFTER:
                    raise ProbeLost(
                        f"ComfyUI stopped answering during the render: {type(exc).__name__}: {exc}"
                    ) from None
                continue
            if entry is not None:
                return verdict_of(job_id, entry)

    async def interrupt(self, base_url: str, job_id: str) -> None:
        try:
            await self.client.post(base_url + "/queue", json={"delete": [job_id]})
            await self.client.post(base_url + "/interrupt", json={"prompt_id": job_id})
        finally:
            await self._linger(job_id)

    async def _entry(self, base_url: str, job_id: str) -> dict[str, Any] | None:
        r = await self.client.get(f"{base_url}/history/{job_id}")
        r.raise_for_status()
        found = _json(r.content)
        entry = found.get(job_id) if isinstance(found, dict) else None
        if not isinstance(entry, dict):
            return None
        status = entry.get("status")
        # An entry is written once its prompt ended; one without a status is from
        # a ComfyUI older than statuses: ended too.
        return entry if status is None or isinstance(status, dict) else None

    async def _queued(self, base_url: str, job_id: str) -> bool:
        r = await self.client.get(base_url + "/queue")
        r.raise_for_status()
        doc = _json(r.content)
        if not isinstance(doc, dict):
            return True  # unreadable: not evidence that it is gone
        items = [*doc.get("queue_running", []), *doc.get("queue_pending", [])]
        return any(isinstance(i, list) and len(i) > 1 and i[1] == job_id for i in items)


def verdict_of(prompt_id: str, entry: dict[str, Any]) -> Verdict:
    """A finished prompt's history entry as the request's end."""
    status = entry.get("status") or {}
    kept = json.dumps({prompt_id: entry}).encode()
    if status.get("status_str", "success") == "success" and status.get("completed", True):
        return Verdict(ok=True, status=200, result=kept)
    for event, data in reversed(status.get("messages") or []):
        if event == "execution_interrupted":
            return Verdict(ok=False, status=None, error="interrupted in ComfyUI", result=kept)
        if event == "execution_error":
            where = f"node {data.get('node_id')} ({data.get('node_type')})"
            message = data.get("exception_message") or "failed"
            error = f"ComfyUI: execution_error in {where}: {message}"
            return Verdict(ok=False, status=500, error=error, result=kept)
    return Verdict(ok=False, status=500, error="ComfyUI: the prompt failed", result=kept)


def failed_entry(prompt_id: str, event: str, data: dict[str, Any]) -> bytes:
    """A history entry for a prompt that ended without ComfyUI writing one (refused,
    cancelled in gpulane's queue, failed there), in ComfyUI's shape."""
    entry = {
        "prompt": [0, prompt_id, {}, {}, []],
        "outputs": {},
        "status": {"status_str": "error", "completed": False, "messages": [[event, data]]},
        "meta": {},
    }
    return json.dumps({prompt_id: entry}).encode()


def _progress_of(doc: Any, job_id: str) -> tuple[int, int] | None:
    """(value, max) of a `progress` message about `job_id`, else None."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict) or doc.get("type") != "progress":
        return None
    value, most = data.get("value"), data.get("max")
    if data.get("prompt_id") != job_id or not (isinstance(value, int) and isinstance(most, int)):
        return None
    return (value, most) if 0 <= value <= most and most > 0 else None


def _prompt_id(body: bytes) -> str:
    doc = _json(body)
    return str(doc.get("prompt_id", "")) if isinstance(doc, dict) else ""


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
