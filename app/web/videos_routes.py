"""OpenAI's Videos API through gpulane: `/v1/videos` for models with `kind: openai-videos`.

`POST /v1/videos` (JSON or multipart/form-data, as OpenAI's spec allows) is a
durable job in gpulane's queue like any other (priority header, caller, fair
share, chains, admission limits, explain): gpulane gives the video its id,
answers at once with the video `queued` once the job is on disk, and sends it
when its turn comes, loading its server if needed. The render then holds its
model until the server says it ended (app/jobs/held.py, app/jobs/videos.py);
its content is fetched then and kept on gpulane's disk, so `GET
/v1/videos/{id}/content` answers after the server was swapped out.

The video object is the spec's `VideoResource` (openai/openai-openapi), from
gpulane's job: `queued` while it waits in gpulane (its place and estimated
start in `gpulane`, a field of gpulane's own), `in_progress` with the server's
`progress` while it renders, then `completed` or `failed` (`error: {code,
message}`). With apiKeys a user key sees, fetches and deletes only its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from litestar import asgi
from litestar.handlers import BaseRouteHandler
from litestar.types import Receive, Scope, Send
from sqlalchemy import Engine

from app.config import Config
from app.core.priority import HEADER, grant, read_priority, unreadable_priority
from app.jobs.durable import JobRequest, Jobs
from app.jobs.errors import JobsError
from app.jobs.held import HeldRuns
from app.jobs.job_view import job_view
from app.jobs.videos import DOOR, ENDPOINT, KIND, KIND_NAME, VARIANTS, VideoProbe, VideoStore
from app.report.live_queue import position_of
from app.runtime.api import Admission
from app.runtime.scheduler import Scheduler
from app.store.job_results import job_rows, list_jobs, store_result
from app.web.access import identity, only_caller
from app.web.auth import Identity, identify
from app.web.chain_headers import read_chain
from app.web.errors import send_error, send_json
from app.web.files import parse_multipart
from app.web.jobs import accept_or_answer
from app.web.refusals import Asked, record
from app.web.request_body import BadRequest, max_wait_ns, read_body, rename_form_model

log = logging.getLogger("gpulane.jobs")

MAX_PROMPT = 32000
"""The spec's `maxLength` of `prompt`."""
LISTED = 1000
"""The newest durable jobs `GET /v1/videos` looks through."""
CHUNK = 1 << 20
_ENDED = {"completed": "completed", "queued": "queued", "running": "in_progress"}
_DELETED = b'{"object": "video.deleted"}'


class VideoDoor:
    def __init__(self, config: Config, scheduler: Scheduler, jobs: Jobs, store: VideoStore) -> None:
        self.config = config
        self.scheduler = scheduler
        self.jobs = jobs
        self.engine: Engine = jobs.engine
        self.store = store
        self.probe = VideoProbe(store)

    async def aclose(self) -> None:
        await self.probe.aclose()

    async def prune_forever(self, every_s: float = 3600.0) -> None:
        """Content past jobs.resultRetention goes (the cap is kept at each video's end)."""
        while True:
            try:
                await asyncio.to_thread(self.store.prune)
            except OSError:
                log.exception("pruning videos' content failed")
            await asyncio.sleep(every_s)

    async def mounted(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = str(scope.get("method", "GET"))
        raw = scope.get("raw_path") or scope["path"].encode()
        path = raw.decode("latin-1").split("?", 1)[0].removeprefix("/v1/videos").strip("/")
        parts = path.split("/") if path else []
        query = dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))
        only = only_caller(identity(scope))
        try:
            if not parts and method == "POST":
                await self._create(scope, receive, send, None)
            elif not parts and method == "GET":
                await self._list(send, only, query)
            elif len(parts) == 1 and parts[0] not in ("edits", "extensions", "characters"):
                if method == "GET":
                    await self._retrieve(send, only, parts[0])
                elif method == "DELETE":
                    await self._delete(send, only, parts[0])
                else:
                    await _not_served(send, method, path)
            elif len(parts) == 2 and parts[1] == "content" and method == "GET":
                await self._content(send, only, parts[0], query.get("variant") or "video")
            elif len(parts) == 2 and parts[1] == "remix" and method == "POST":
                await self._create(scope, receive, send, (only, parts[0]))
            else:
                await _not_served(send, method, path)
        except BadRequest as exc:
            await send_error(send, exc.status, exc.message, code=exc.code, param=exc.param)
        except ConnectionError:
            return

    # -- creating ---------------------------------------------------------------

    async def _create(
        self, scope: Scope, receive: Receive, send: Send, remix: tuple[str | None, str] | None
    ) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        asked_priority = read_priority(headers.get(HEADER.lower()))
        # What is known of the request when it is refused, for its record.
        asked = Asked(ENDPOINT, priority=grant(asked_priority))
        try:
            who = identify(scope, headers)
            asked = asked._replace(priority=who.grant(asked_priority), caller=who.caller)
            body = await read_body(receive, self.config.max_body_bytes)
            fields = _fields(body, headers.get("content-type", ""))
            if remix is None and fields.get("model") not in (None, ""):
                asked = asked._replace(model=str(fields["model"]))
            admission, job = await self._job(headers, who, body, fields, remix)
        except BadRequest as exc:
            recorded = record(self.scheduler, asked, exc.status, exc.message)
            await send_error(
                send, exc.status, exc.message, code=exc.code, param=exc.param, headers=recorded
            )
            return
        accepted = await accept_or_answer(self.jobs, send, admission, job)
        if accepted is None:
            return
        video = await self._video(None, accepted.request_id)
        doc = self._object(video) if video is not None else _queued(job.meta or {})
        extra = [(b"x-request-id", accepted.request_id.encode())]
        await send_json(send, 200, json.dumps(doc).encode(), extra)

    async def _job(
        self,
        headers: dict[str, str],
        who: Identity,
        body: bytes,
        fields: dict[str, Any],
        remix: tuple[str | None, str] | None,
    ) -> tuple[Admission, JobRequest]:
        """The video's admission and job; BadRequest naming what is wrong."""
        prompt = fields.get("prompt")
        if not isinstance(prompt, str) or not 1 <= len(prompt) <= MAX_PROMPT:
            message = f"prompt is required: a string of 1 to {MAX_PROMPT} characters"
            raise BadRequest(400, message, "invalid_value", "prompt")
        meta: dict[str, Any] = {
            "id": "video_" + uuid.uuid4().hex,
            "prompt": prompt,
            "created_at": int(time.time()),
            "remixed_from_video_id": None,
        }
        if remix is None:
            model, asked = self._model(fields.get("model"))
            meta |= {"model": asked, "size": fields.get("size"), "seconds": fields.get("seconds")}
            path = "/v1/videos"
            body = self._renamed(body, headers.get("content-type", ""), model, fields)
        else:
            source = await self._video(remix[0], remix[1])
            kept = _kept(source)
            if source is None or source.get("status") != "completed" or not kept.get("upstream_id"):
                why = "is not a completed video" if source is not None else "does not exist"
                if source is not None and source.get("status") == "completed":
                    why = "was answered by its server with bytes, without an id to remix"
                message = f"video {remix[1]} {why}: only a completed video can be remixed"
                raise BadRequest(400 if source is not None else 404, message, "invalid_video")
            model = str(source["model"])
            smeta = source.get("meta") or {}
            meta |= {"model": smeta.get("model") or model, "remixed_from_video_id": remix[1]}
            meta |= {"size": smeta.get("size"), "seconds": smeta.get("seconds")}
            path = f"/v1/videos/{kept['upstream_id']}/remix"
            body = json.dumps({"prompt": prompt}).encode()
            headers["content-type"] = "application/json"
        asked_priority = read_priority(headers.get(HEADER.lower()))
        chain, chain_length = read_chain(headers)
        admission = Admission(
            model=model,
            model_requested=str(meta["model"]),
            endpoint="/v1/videos",
            priority=who.grant(asked_priority),
            requested_priority=asked_priority,
            priority_unreadable=unreadable_priority(headers.get(HEADER.lower())),
            caller=who.caller,
            max_wait_ns=max_wait_ns(headers),
            chain=chain,
            chain_length=chain_length,
        )
        job = JobRequest(
            method="POST",
            path=path,
            query="",
            body=body,
            headers=headers,
            door=DOOR,
            request_id=meta["id"],
            meta=meta,
        )
        return admission, job

    def _model(self, asked: Any) -> tuple[str, str]:
        """The model a video is for, and its name as asked: the one named, else the
        only model with `kind: openai-videos`."""
        videos = [m.id for m in self.config.models.values() if m.kind == KIND_NAME]
        if asked is None or asked == "":
            if len(videos) == 1:
                return videos[0], videos[0]
            named = ", ".join(videos) or "none is configured"
            message = f"model is required here: one of the video models ({named})"
            raise BadRequest(400, message, "invalid_value", "model")
        model = self.config.resolve_model(str(asked))
        if model is None or self.config.models[model].kind != KIND_NAME:
            named = ", ".join(videos) or "none: give a model `kind: openai-videos`"
            what = "is not configured" if model is None else "is not a video server"
            message = f"model {asked!r} {what}; video models: {named}"
            raise BadRequest(404 if model is None else 400, message, "model_not_found", "model")
        return model, str(asked)

    def _renamed(self, body: bytes, content_type: str, model: str, fields: dict[str, Any]) -> bytes:
        """The body as the server is to get it: its `useModelName`, if set."""
        name = self.config.models[model].use_model_name
        if not name or fields.get("model") == name:
            return body
        if content_type.startswith("multipart/form-data"):
            return rename_form_model(body, content_type, name) if "model" in fields else body
        return json.dumps(fields | {"model": name}).encode()

    # -- reading ----------------------------------------------------------------

    async def _video(self, only: str | None, video_id: str) -> dict[str, Any] | None:
        """The job of a video seen by `only` (None: everyone), with its `meta`;
        None when there is none, or it was deleted."""
        row, result = await asyncio.to_thread(job_rows, self.engine, video_id)
        return self._view(video_id, row, result, only)

    def _view(
        self, video_id: str, row: Any, result: Any, only: str | None
    ) -> dict[str, Any] | None:
        live = self.scheduler.open_status(video_id)
        open_request = self.scheduler.live().state.requests.get(video_id)
        caller = open_request.caller if open_request is not None else None
        view = job_view(video_id, row, result, live, caller)
        if view is None or (only is not None and view.get("caller") != only):
            return None
        if row is None and (open_request is None or open_request.endpoint != ENDPOINT):
            return None  # not yet in the read model, and not a video
        job = row["job"] if row is not None else None
        job = json.loads(job) if isinstance(job, str) else job or {}
        if row is not None and job.get("door") != DOOR:
            return None
        if result is not None and bytes(result["body"] or b"") == _DELETED:
            return None
        view["meta"] = job.get("meta") or {}
        return view

    def _object(self, view: dict[str, Any]) -> dict[str, Any]:
        """The spec's `VideoResource`, with `gpulane` of gpulane's own."""
        meta = view.get("meta") or {}
        video_id = view["id"]
        status = _ENDED.get(str(view.get("status")), "failed")
        if status == "in_progress" and video_id not in self.probe.sent:
            status = "queued"  # dispatched, its server loading: not rendering yet
        kept = _kept(view)
        finished = view.get("finished_at")
        completed_at = int(finished) if status == "completed" and finished else None
        retention = self.config.result_retention_s
        expires_at = int(completed_at + retention) if completed_at is not None else None
        progress = {"completed": 100, "queued": 0}.get(status)
        if progress is None:
            progress = self.probe.percent.get(video_id, 0) if status == "in_progress" else 0
        error = None
        if status == "failed":
            found = kept.get("error")
            said: dict[str, Any] = found if isinstance(found, dict) else {}
            code = said.get("code") or str(view.get("status") or "failed")
            error = {"code": code, "message": view.get("error") or said.get("message") or code}
        created = meta.get("created_at") or int(view.get("enqueued_at") or time.time())
        ours: dict[str, Any] = {"status": view.get("status"), "attempt": view.get("attempt")}
        if status == "queued":
            live = self.scheduler.live()
            times = self.scheduler.durations()
            found = position_of(live.state, live.running_since, live.now_ns, times, video_id)
            if found is not None:
                place, depth, start_ns, open_end = found
                ours |= {"place": place, "queue_depth": depth}
                ours |= {"expected_start": round(start_ns / 1e9, 3), "open": open_end}
        return {
            "id": video_id,
            "object": "video",
            "model": meta.get("model") or view.get("model"),
            "status": status,
            "progress": progress,
            "created_at": created,
            "completed_at": completed_at,
            "expires_at": expires_at,
            "prompt": meta.get("prompt"),
            "size": meta.get("size") or kept.get("size") or "720x1280",
            "seconds": str(meta.get("seconds") or kept.get("seconds") or "4"),
            "remixed_from_video_id": meta.get("remixed_from_video_id"),
            "error": error,
            "gpulane": ours,
        }

    async def _retrieve(self, send: Send, only: str | None, video_id: str) -> None:
        view = await self._video(only, video_id)
        if view is None:
            await _no_video(send, video_id)
            return
        await send_json(send, 200, json.dumps(self._object(view)).encode())

    async def _list(self, send: Send, only: str | None, query: dict[str, str]) -> None:
        """The spec's `VideoListResource`: `limit` (0-100, 20), `order` (`desc`:
        newest first, `asc`), `after` (an id of the previous page)."""
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = -1
        if not 0 <= limit <= 100:
            raise BadRequest(
                400, "limit must be an integer from 0 to 100", "invalid_value", "limit"
            )
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(400, "order must be asc or desc", "invalid_value", "order")
        found = await asyncio.to_thread(list_jobs, self.engine, None, LISTED, only)
        views = [self._view(row["id"], row, result, only) for row, result in found]
        listed = [v for v in views if v is not None]
        if order == "asc":
            listed.reverse()
        after = query.get("after")
        if after:
            ids = [v["id"] for v in listed]
            listed = listed[ids.index(after) + 1 :] if after in ids else []
        # Objects for the page only: a waiting one's place walks the queue.
        page = [self._object(v) for v in listed[:limit]]
        doc = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(listed) > limit,
        }
        await send_json(send, 200, json.dumps(doc).encode())

    async def _content(self, send: Send, only: str | None, video_id: str, variant: str) -> None:
        if variant not in VARIANTS:
            message = f"variant {variant!r} is not one of {', '.join(VARIANTS)}"
            raise BadRequest(400, message, "invalid_value", "variant")
        view = await self._video(only, video_id)
        if view is None:
            await _no_video(send, video_id)
            return
        status = self._object(view)["status"]
        if status != "completed":
            message = f"video {video_id} is {status}: its content is there once it is completed"
            await send_error(send, 409, message, code="video_not_ready")
            return
        if variant not in (_kept(view).get("variants") or []):
            message = f"the video server did not provide a {variant} for video {video_id}"
            await send_error(send, 404, message, code="variant_not_available", param="variant")
            return
        path = self.store.path(video_id, variant)
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            message = (
                f"the {variant} of video {video_id} is no longer kept: past "
                "jobs.resultRetention, or removed to stay under jobs.maxVideoBytes"
            )
            await send_error(send, 410, message, code="video_expired")
            return
        with handle:
            size = path.stat().st_size
            head = [(b"content-type", KIND[variant].encode()), (b"content-length", b"%d" % size)]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            while True:
                chunk = await asyncio.to_thread(handle.read, CHUNK)
                more = len(chunk) == CHUNK
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                if not more:
                    break

    # -- deleting ---------------------------------------------------------------

    async def _delete(self, send: Send, only: str | None, video_id: str) -> None:
        """The spec's delete: a waiting or rendering video is cancelled first (its
        server drops it); its content and its object are gone after."""
        view = await self._video(only, video_id)
        if view is None:
            await _no_video(send, video_id)
            return
        if self.scheduler.open_status(video_id) is not None:
            with contextlib.suppress(JobsError):  # it may have ended meanwhile
                await self.jobs.cancel(only, video_id)
        await asyncio.to_thread(
            store_result, self.engine, video_id, 200, [], _DELETED, self.jobs.fence
        )
        await asyncio.to_thread(self.store.delete, video_id)
        doc = {"object": "video.deleted", "deleted": True, "id": video_id}
        await send_json(send, 200, json.dumps(doc).encode())


def _fields(body: bytes, content_type: str) -> dict[str, Any]:
    """The request's fields: a JSON object, or a form's parts (text ones decoded;
    an uploaded `input_reference` is passed on to the server as sent)."""
    if content_type.lower().startswith("multipart/form-data"):
        parts = parse_multipart(body, content_type)
        return {
            name: (content.decode("utf-8", "replace") if filename is None else content)
            for name, (filename, content) in parts.items()
        }
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        raise BadRequest(
            400, "the body is not JSON (or multipart/form-data)", "invalid_json"
        ) from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "the body is not a JSON object", "invalid_json")
    return doc


def _kept(view: dict[str, Any] | None) -> dict[str, Any]:
    """The server's last object for a video, as gpulane kept it ({} if none)."""
    body = ((view or {}).get("result") or {}).get("body")
    return body if isinstance(body, dict) else {}


def _queued(meta: dict[str, Any]) -> dict[str, Any]:
    """A video just accepted, before the read model has its row."""
    return {
        "id": meta["id"],
        "object": "video",
        "model": meta.get("model"),
        "status": "queued",
        "progress": 0,
        "created_at": meta["created_at"],
        "completed_at": None,
        "expires_at": None,
        "prompt": meta.get("prompt"),
        "size": meta.get("size") or "720x1280",
        "seconds": str(meta.get("seconds") or "4"),
        "remixed_from_video_id": meta.get("remixed_from_video_id"),
        "error": None,
        "gpulane": {"status": "queued"},
    }


async def _no_video(send: Send, video_id: str) -> None:
    await send_error(send, 404, f"no video {video_id!r}", code="video_not_found")


async def _not_served(send: Send, method: str, path: str) -> None:
    message = (
        f"{method} /v1/videos/{path} is not served by gpulane; served: POST /v1/videos, "
        "GET /v1/videos, GET and DELETE /v1/videos/{id}, GET /v1/videos/{id}/content, "
        "POST /v1/videos/{id}/remix"
    )
    await send_error(send, 404, message.replace("/v1/videos/ ", "/v1/videos "), code="not_found")


def open_videos(config: Config, scheduler: Scheduler, jobs: Jobs, folder: str) -> VideoDoor:
    """The Videos API door, its videos sent by the held runner with its probe."""
    store = VideoStore(Path(folder), config.max_video_bytes, config.result_retention_s)
    door = VideoDoor(config, scheduler, jobs, store)
    jobs.senders[DOOR] = HeldRuns(scheduler, {DOOR: door.probe})
    return door


def videos_routes(door: VideoDoor) -> list[BaseRouteHandler]:
    """`/v1/videos` and everything under it, any method."""

    async def videos(scope: Scope, receive: Receive, send: Send) -> None:
        await door.mounted(scope, receive, send)

    return [asgi(path="/v1/videos", is_mount=True, copy_scope=False)(videos)]
