"""OpenAI's Videos API upstream: how gpulane sends a video and learns that it ended.

A server that speaks the API asynchronously (OpenAI's own shape) answers `POST
/v1/videos` at once with the video `queued`, and `GET /v1/videos/{id}` is then
`in_progress` with `progress` until `completed` or `failed` (`error: {code,
message}`). The probe polls that object, holding the lane throughout (the held
runner, app/jobs/held.py); a server that answers the POST with the video
already `completed` (or with the video's bytes) held the lane for that request
only. When the video completes its content is fetched while the server still
runs (the video, and the `thumbnail` and `spritesheet` variants the server
has) and kept on gpulane's disk (`VideoStore`), so `/content` answers after the
server was swapped out.

The upstream's video id is the probe's to know: it is in memory while the
video runs, and in the kept result (the upstream's last object) after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx

from app.config import Config
from app.jobs.held import ProbeLost, Verdict

log = logging.getLogger("gpulane.jobs")

DOOR = "videos"
"""The jobs' door: their sender is the held runner with `VideoProbe`."""
KIND_NAME = "openai-videos"
"""The `kind` of a model that serves the Videos API."""
ENDPOINT = "/v1/videos"
POLL_S = 0.5
"""Between two reads of a rendering video's object."""
SUBMIT_TIMEOUT = httpx.Timeout(None, connect=5.0)
"""The create's: unbounded reads (a synchronous server answers when it rendered)."""
LOST_AFTER = 5
"""Failed reads in a row after which the server is taken to be gone."""
VARIANTS = ("video", "thumbnail", "spritesheet")
"""The spec's `VideoContentVariant`s: `video` is fetched always, the others where
the server has them."""
KIND = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/webp"}


def batch_line(config: Config, model: str, request_id: str, body: bytes) -> dict[str, Any]:
    """What a Batch API line for `/v1/videos` adds to its job: the door and the
    video's description, for a model with `kind: openai-videos` (another model
    gets the line as a plain request)."""
    if config.models[model].kind != KIND_NAME:
        return {}
    doc = _json(body)
    doc = doc if isinstance(doc, dict) else {}
    meta = {
        "id": request_id,
        "prompt": doc.get("prompt"),
        "created_at": int(time.time()),
        "remixed_from_video_id": None,
        "model": doc.get("model") or model,
        "size": doc.get("size"),
        "seconds": doc.get("seconds"),
    }
    return {"door": DOOR, "meta": meta}


class VideoStore:
    """Finished videos' content on gpulane's disk, one file per (video, variant),
    within `jobs.maxVideoBytes` (the oldest go first) and `jobs.resultRetention`."""

    def __init__(self, folder: Path, cap: int, retention_s: float) -> None:
        self.folder = folder
        self.cap = cap
        self.retention_s = retention_s

    def path(self, video_id: str, variant: str) -> Path:
        return self.folder / f"{video_id}.{variant}"

    def has(self, video_id: str, variant: str) -> bool:
        return self.path(video_id, variant).is_file()

    def partial(self, video_id: str, variant: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f".{video_id}.{variant}.part"

    def keep(self, video_id: str, variant: str, partial: Path) -> bool:
        """Move a fetched file in, then make room under the cap (never by removing
        it); False when it alone is over the cap: not kept."""
        size = partial.stat().st_size
        if size > self.cap:
            partial.unlink(missing_ok=True)
            return False
        os.replace(partial, self.path(video_id, variant))
        self.prune(keep=video_id)
        return True

    def delete(self, video_id: str) -> None:
        for variant in VARIANTS:
            self.path(video_id, variant).unlink(missing_ok=True)

    def prune(self, keep: str | None = None) -> int:
        """Files past the retention, then the oldest until under the cap; how many."""
        if not self.folder.is_dir():
            return 0
        files = []
        for entry in os.scandir(self.folder):
            if entry.is_file() and not entry.name.startswith("."):
                info = entry.stat()
                files.append((info.st_mtime, info.st_size, Path(entry.path)))
        files.sort()
        total = sum(size for _, size, _ in files)
        cutoff = time.time() - self.retention_s
        removed = 0
        for mtime, size, path in files:
            if mtime >= cutoff and total <= self.cap:
                break
            if keep is not None and path.name.startswith(keep + "."):
                continue
            path.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed


class VideoProbe:
    """`app.jobs.held.Probe` for a server of OpenAI's Videos API."""

    def __init__(self, store: VideoStore, poll_s: float = POLL_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
        self.upstream_ids: dict[str, str] = {}
        """gpulane's video id -> the server's, while it renders."""
        self.percent: dict[str, int] = {}
        """gpulane's video id -> the server's last `progress` (0-100), while it renders."""
        self.sent: set[str] = set()
        """gpulane's video ids handed to their server, until they end: `in_progress`
        (before, a dispatched video waits for its server to load: `queued`)."""

    async def aclose(self) -> None:
        await self.client.aclose()

    def progress(self, job_id: str) -> tuple[int, int] | None:
        """`app.jobs.held.ReportsProgress`: the server's `progress` as (percent,
        100), which drives the running video's expected end."""
        percent = self.percent.get(job_id)
        return None if percent is None else (percent, 100)

    async def finished(self, base_url: str, job_id: str) -> Verdict | None:
        # The server's id was in memory only: a video sent again renders again.
        return None

    async def submit(self, base_url: str, job: dict[str, Any], body: bytes) -> Verdict | None:
        video_id = job["meta"]["id"]
        self.sent.add(video_id)
        try:
            ended = await self._submit(base_url, video_id, job, body)
        except ProbeLost:
            self._forget(video_id)
            raise
        if ended is not None:
            self._forget(video_id)  # refused, or answered synchronously: rendered in this request
        return ended

    async def _submit(
        self, base_url: str, video_id: str, job: dict[str, Any], body: bytes
    ) -> Verdict | None:
        headers = {"content-type": job["headers"].get("content-type", "application/json")}
        try:
            # A server that renders before it answers takes as long as the render:
            # maxRunTime bounds it, not a read timeout.
            r = await self.client.post(
                base_url + job["path"], content=body, headers=headers, timeout=SUBMIT_TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise ProbeLost(f"the video server did not take the video: {_why(exc)}") from None
        if r.status_code >= 400:
            said = _message(r)
            if job["path"].endswith("/remix") and r.status_code in (404, 405):
                error = f"the video server does not support remix ({r.status_code}: {said})"
                return _failed(video_id, r.status_code, "remix_not_supported", error)
            error = f"the video server refused the video ({r.status_code}): {said}"
            return _failed(video_id, r.status_code, "upstream_refused", error)
        if r.headers.get("content-type", "").startswith("video/"):
            # A server that answers with the video itself: rendered in this request.
            partial = self.store.partial(video_id, "video")
            partial.write_bytes(r.content)
            if not await asyncio.to_thread(self.store.keep, video_id, "video", partial):
                log.warning("video %s: its video is over jobs.maxVideoBytes: not kept", video_id)
            done = {"id": video_id, "status": "completed", "progress": 100, "variants": ["video"]}
            return Verdict(ok=True, status=200, result=json.dumps(done).encode())
        video = _json(r.content)
        if not isinstance(video, dict) or not isinstance(video.get("id"), str):
            error = f"the video server answered without a video id: {r.text[:200]}"
            return _failed(video_id, 502, "upstream_error", error)
        self.upstream_ids[video_id] = video["id"]
        return await self._ended(base_url, video_id, video)

    async def wait(self, base_url: str, job_id: str) -> Verdict:
        upstream_id = self.upstream_ids.get(job_id)
        if upstream_id is None:
            raise ProbeLost(f"video {job_id} was not taken by the video server")
        try:
            verdict = await self._poll(base_url, job_id, upstream_id)
        except ProbeLost:
            self._forget(job_id)
            raise
        # Not on a cancel: `interrupt` still needs the server's id then.
        self._forget(job_id)
        return verdict

    async def _poll(self, base_url: str, job_id: str, upstream_id: str) -> Verdict:
        misses = 0
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                r = await self.client.get(f"{base_url}/v1/videos/{upstream_id}")
            except httpx.HTTPError as exc:
                misses += 1
                if misses >= LOST_AFTER:
                    raise ProbeLost(f"the video server stopped answering: {_why(exc)}") from None
                continue
            misses = 0
            if r.status_code == 404:
                raise ProbeLost(f"the video server dropped video {upstream_id}")
            video = _json(r.content)
            if r.status_code != 200 or not isinstance(video, dict):
                continue
            ended = await self._ended(base_url, job_id, video)
            if ended is not None:
                return ended

    def _forget(self, job_id: str) -> None:
        self.sent.discard(job_id)
        self.percent.pop(job_id, None)
        self.upstream_ids.pop(job_id, None)

    async def interrupt(self, base_url: str, job_id: str) -> None:
        # The API has no cancel: deleting the video is how a client drops one.
        upstream_id = self.upstream_ids.get(job_id)
        self._forget(job_id)
        if upstream_id is not None:
            await self.client.delete(f"{base_url}/v1/videos/{upstream_id}")

    async def _ended(self, base_url: str, video_id: str, video: dict[str, Any]) -> Verdict | None:
        """The verdict of a video the server says ended; None while it renders."""
        status = video.get("status")
        progress = video.get("progress")
        if isinstance(progress, int | float) and math.isfinite(progress):
            self.percent[video_id] = max(0, min(100, int(progress)))
        if status == "failed":
            error = video.get("error") or {}
            code = str(error.get("code") or "video_generation_failed")
            message = str(error.get("message") or "the video server says the video failed")
            return Verdict(
                ok=False,
                status=500,
                error=f"the video server: {code}: {message}",
                result=json.dumps(_ours(video_id, video)).encode(),
            )
        if status != "completed":
            return None
        variants = []
        for variant in VARIANTS:
            # One over jobs.maxVideoBytes was provided all the same: /content says so (410).
            if await self._fetch(base_url, video_id, str(video["id"]), variant) is not None:
                variants.append(variant)
        if "video" not in variants:
            error = (
                "the video server says the video completed, but its content could not be fetched"
            )
            kept = _ours(video_id, video)
            return Verdict(ok=False, status=502, error=error, result=json.dumps(kept).encode())
        kept = _ours(video_id, video) | {"variants": variants}
        return Verdict(ok=True, status=200, result=json.dumps(kept).encode())

    async def _fetch(
        self, base_url: str, video_id: str, upstream_id: str, variant: str
    ) -> bool | None:
        """Fetch one variant's content onto gpulane's disk: whether it was kept
        (False: over jobs.maxVideoBytes); None when the server did not provide it."""
        url = f"{base_url}/v1/videos/{upstream_id}/content"
        params = {} if variant == "video" else {"variant": variant}
        partial = self.store.partial(video_id, variant)
        try:
            async with self.client.stream("GET", url, params=params) as r:
                if r.status_code != 200:
                    return None
                with partial.open("wb") as f:
                    async for chunk in r.aiter_bytes():
                        f.write(chunk)
        except httpx.HTTPError as exc:
            log.warning("video %s: its %s could not be fetched: %s", video_id, variant, _why(exc))
            partial.unlink(missing_ok=True)
            return None
        kept = await asyncio.to_thread(self.store.keep, video_id, variant, partial)
        if not kept:
            log.warning("video %s: its %s is over jobs.maxVideoBytes: not kept", video_id, variant)
        return kept


def _ours(video_id: str, video: dict[str, Any]) -> dict[str, Any]:
    """The server's last object as gpulane keeps it (a batch line's answer too):
    gpulane's id, the server's own in `upstream_id` (a remix is sent to it)."""
    return video | {"id": video_id, "upstream_id": video.get("id")}


def _failed(video_id: str, status: int, code: str, message: str) -> Verdict:
    error = {"id": video_id, "status": "failed", "error": {"code": code, "message": message}}
    return Verdict(ok=False, status=status, error=message, result=json.dumps(error).encode())


def _message(r: httpx.Response) -> str:
    doc = _json(r.content)
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return r.text[:200]


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _json(raw: bytes) -> Any:
    with contextlib.suppress(ValueError):
        return json.loads(raw)
    return None
