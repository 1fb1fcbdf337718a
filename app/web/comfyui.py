"""ComfyUI's probe: how gpulane sends a prompt and learns that its render ended.

ComfyUI (v0.3.64, its `server.py` and `execution.py`) answers `POST /prompt`
at once and renders in a worker thread; `GET /history/{prompt_id}` is `{}`
until the prompt ends, then holds its entry, whose `status` says how it ended
(`status_str` success or error; the messages name an `execution_error` or an
`execution_interrupted`). The probe polls that entry, and checks now and then
that the prompt is still in ComfyUI's queue, so a prompt ComfyUI dropped (its
queue cleared, the server restarted) ends instead of holding the model forever.

How far a render is comes from ComfyUI's websocket: the probe opens its own
(`/ws?clientId=gpulane-...`, never the client's id: ComfyUI gives a socket's id
to the newest connection, which would take the client's), and reads `progress`
(`{"value", "max", "prompt_id", "node"}`). ComfyUI sends it to the prompt's
`client_id`, or to every socket when the prompt has none (`main.py`
`hijack_progress`, `server.py` `send_json`), so gpulane hears the progress of
prompts sent without a `client_id` only. The end is still learnt from the
history: a socket that fails costs the progress, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import connect
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

log = logging.getLogger("gpulane.jobs")


class ComfyProbe:
    """`app.jobs.held.Probe` for ComfyUI."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0))
        self._progress: dict[str, tuple[int, int]] = {}

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
        try:
            r = await self.client.post(base_url + job["path"], content=body, headers=headers)
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise ProbeLost(f"ComfyUI did not take the prompt: {why}") from None
        if r.status_code == 200:
            return None
        answer = _json(r.content)
        error = answer.get("error") if isinstance(answer, dict) else None
        said = error.get("message") if isinstance(error, dict) else None
        message = f"ComfyUI refused the prompt ({r.status_code}): {said or r.text[:200]}"
        data: dict[str, Any] = {"prompt_id": _prompt_id(body), "exception_message": message}
        if isinstance(answer, dict):
            data |= {"error": answer.get("error"), "node_errors": answer.get("node_errors", {})}
        entry = failed_entry(_prompt_id(body), "execution_error", data)
        return Verdict(ok=False, status=r.status_code, error=message, result=entry)

    def progress(self, job_id: str) -> tuple[int, int] | None:
        return self._progress.get(job_id)

    async def wait(self, base_url: str, job_id: str) -> Verdict:
        listener = asyncio.ensure_future(self._listen(base_url, job_id))
        try:
            return await self._wait(base_url, job_id)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            self._progress.pop(job_id, None)

    async def _listen(self, base_url: str, job_id: str) -> None:
        """Keep the render's last `progress` until cancelled (one socket per render)."""
        client_id = f"gpulane-{uuid.uuid4().hex}"
        url = "ws" + base_url.removeprefix("http") + f"/ws?clientId={client_id}"
        # A short close: the render's end waits for this socket to be let go.
        options: dict[str, Any] = {
            "max_size": WS_MAX_BYTES,
            "open_timeout": 5.0,
            "close_timeout": 1.0,
        }
        if int(websockets_version.split(".")[0]) >= 15:
            options["proxy"] = None  # a local server: no environment proxy
        try:
            async with connect(url, **options) as socket:
                async for message in socket:
                    if isinstance(message, bytes):
                        continue  # previews
                    seen = _progress_of(_json(message.encode()), job_id)
                    if seen is not None:
                        self._progress[job_id] = seen
        except (OSError, TimeoutError, websockets.WebSocketException) as exc:
            log.info("job %s: no progress from ComfyUI's websocket: %s", job_id, exc)
        except Exception:  # progress is a nicety: it never fails the render
            log.exception("job %s: reading ComfyUI's websocket failed", job_id)

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
        await self.client.post(base_url + "/queue", json={"delete": [job_id]})
        await self.client.post(base_url + "/interrupt", json={"prompt_id": job_id})

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
