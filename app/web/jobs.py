"""Durable jobs: `Prefer: respond-async` requests that survive a restart.

The body is stored once, as bytes (app/store/job_bodies.py), and then the
enqueue event, carrying the rest of what is needed to run the request again
(method, path, headers, the body's length and sha256), is on disk before the
caller gets `202 Accepted`. A body that would leave the database's disk with
less than `jobs.minFreeDisk` free is refused with 507. The job then waits its
turn like any request; when dispatched, gpulane itself sends it upstream and
stores the answer in `job_results` before recording the completion, so a
completed job always has its result; its body goes with its terminal event.

A user key sees, fetches and cancels only its own jobs (app/web/access.py); an
idempotency key belongs to the caller that sent it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from typing import Any

import msgspec
from litestar import Request, Response, delete, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from litestar.types import Message, Send
from sqlalchemy import Engine

from app.config import Config
from app.config.callers import CREDENTIAL_HEADERS
from app.runtime.admission import Refused
from app.runtime.api import Admission, Ticket, new_request_id
from app.runtime.scheduler import Scheduler
from app.store.engine import describe
from app.store.event_store import write_until_accepted
from app.store.job_bodies import (
    WAL_COPIES,
    BodyMissing,
    delete_body,
    disk_free,
    load_body,
    prune_bodies,
    store_body,
)
from app.store.job_results import (
    find_idempotency_key,
    job_result,
    job_rows,
    list_jobs,
    prune_results,
    store_result,
)
from app.store.port import StoreError
from app.web.access import identity, may_see, only_caller
from app.web.auth import Identity
from app.web.errors import retry_after, send_error, send_json
from app.web.forward import HOP_BY_HOP, Forwarder, Reply, priority_headers, upstream_url
from app.web.responses import DOOR, response_object

log = logging.getLogger("gpulane.jobs")

# Headers that only concern gpulane or the connection, and credentials, which
# never reach the log; the rest is replayed upstream.
_NOT_REPLAYED = HOP_BY_HOP | {"prefer", "idempotency-key"} | CREDENTIAL_HEADERS


class _Captured:
    """An ASGI `send` that keeps the response instead of sending it."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = bytearray()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
            ]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


class JobRunner:
    def __init__(
        self, config: Config, scheduler: Scheduler, forwarder: Forwarder, engine: Engine
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.forwarder = forwarder
        self.engine = engine
        self._keys: dict[tuple[str | None, str], tuple[str, str]] = {}
        """(caller, idempotency key) -> (id, body digest) of the jobs admitted by
        this process. Kept for
        the process's life: a key is then found here or, from earlier runs, on
        disk, with no window between the two (a few hundred bytes per job)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._recording: dict[str, asyncio.Future[bool]] = {}
        """Jobs whose body and enqueue are being written -> whether they were:
        a POST with the same Idempotency-Key waits for it before it answers."""
        self._started_at = time.time()
        """Bodies without a request stored before this are left over by an
        earlier process (its enqueue never reached the disk): pruned."""
        self._credentials: dict[str, dict[str, str]] = {}
        """Credential headers a job's model passes (`passCredentials`), kept in
        memory only until the job runs: never in the log, so a job run after a
        restart goes without them."""

    # -- accepting ------------------------------------------------------------

    async def accept(
        self,
        send: Send,
        admission: Admission,
        method: str,
        path: str,
        query: str,
        body: bytes,
        headers: dict[str, str],
        door: str | None = None,
    ) -> None:
        """Admit a durable job and answer 202 with its view; `door` names another
        door's shape for the answer (`background`: app/web/responses.py)."""
        # Hashing tens of MiB takes a while; hashlib lets go of the GIL meanwhile.
        digest = await asyncio.to_thread(_sha256, body) if len(body) > 1 << 20 else _sha256(body)
        key = headers.get("idempotency-key") or None
        scoped = (admission.caller, key or "")
        if key is not None:
            existing = self._keys.get(scoped)
            if existing is None:
                found = await asyncio.to_thread(
                    find_idempotency_key, self.engine, key, admission.caller
                )
                # Looked up again after the await: a concurrent POST with the same
                # key may have been admitted meanwhile, and it is in `_keys` now.
                existing = self._keys.get(scoped) or found
            if existing is not None:
                await self._send_existing(send, key, existing, digest, door)
                return
        short = self._disk_too_full(len(body))
        if short is not None:
            refusal = Refused(short, status=507, code="insufficient_storage", reason="disk_reserve")
            self.scheduler.refused(admission, refusal)
            await send_error(send, refusal.status, short, code=refusal.code)
            return
        request_id = new_request_id()
        # The body is not in the job: it is stored once, as bytes, under the job's id.
        job = {
            "method": method,
            "path": path,
            "query": query,
            "headers": {k: v for k, v in headers.items() if k not in _NOT_REPLAYED},
            "body_bytes": len(body),
            "body_sha256": digest,
        }
        if door is not None:
            job["door"] = door
        admission = msgspec.structs.replace(
            admission, durable=True, idempotency_key=key, job=job, request_id=request_id
        )
        passed = self.config.models[admission.model].pass_credentials
        credentials = {k: v for k, v in headers.items() if k in CREDENTIAL_HEADERS and k in passed}
        # Reserved before the first await, so no concurrent POST takes the key too;
        # such a POST answers once this one is on disk (or is not: `_send_existing`).
        if key is not None:
            self._keys[scoped] = (request_id, digest)
        recorded = asyncio.get_running_loop().create_future()
        self._recording[request_id] = recorded
        ticket = None
        try:
            ticket = await self._record(send, admission, body, credentials)
        finally:
            del self._recording[request_id]
            recorded.set_result(ticket is not None)
        if ticket is None:
            if key is not None:
                self._keys.pop(scoped, None)
            return
        self.run(ticket, job)
        view = await self.view(ticket.request_id) or {"id": ticket.request_id}
        granted = priority_headers(admission.priority, admission.requested_priority)
        if door == DOOR:
            await _send_json(send, 200, response_object(view), ticket.request_id, granted)
            return
        await _send_json(send, 202, view, ticket.request_id, granted)

    async def _record(
        self, send: Send, admission: Admission, body: bytes, credentials: dict[str, str]
    ) -> Ticket | None:
        """Store the body, then queue the job and wait for its enqueue to be on
        disk: its ticket, or None once the refusal is sent (the body deleted)."""
        assert admission.request_id is not None
        request_id = admission.request_id
        try:
            await asyncio.to_thread(store_body, self.engine, request_id, body)
        except Exception as exc:
            self._forget_body(request_id)
            if "full" in str(exc):
                # SQLITE_FULL: the disk filled up under the reserve's check.
                message = f"the job's body could not be stored: {describe(exc)}"
                await send_error(send, 507, message, code="insufficient_storage")
            else:
                message = f"the job could not be recorded: {describe(exc)}"
                await send_error(send, 503, message, code="event_log_unavailable")
            return None
        try:
            ticket = self.scheduler.admit(admission)
        except Refused as exc:
            self._forget_body(request_id)
            self.scheduler.refused(admission, exc)
            await send_error(
                send, exc.status, str(exc), code=exc.code, headers=retry_after(exc.retry_after)
            )
            return None
        if credentials:
            self._credentials[request_id] = credentials
        try:
            assert ticket.committed is not None
            await asyncio.shield(ticket.committed)
        except StoreError as exc:
            # Not on disk, so not accepted: the scheduler has taken it back out.
            self._credentials.pop(request_id, None)
            self._forget_body(request_id)
            await send_error(
                send, 503, f"the job could not be recorded: {exc}", code="event_log_unavailable"
            )
            return None
        return ticket

    def _disk_too_full(self, size: int) -> str | None:
        """Why a body of `size` bytes may not be stored now (jobs.minFreeDisk), or None."""
        found = disk_free(self.engine)
        if found is None:
            return None
        directory, free = found
        reserve = self.config.min_free_disk
        if free - WAL_COPIES * size >= reserve:
            return None
        return (
            f"not enough disk space for this job: its body ({_size(size)}) needs "
            f"{_size(WAL_COPIES * size)} while it is written (SQLite's write-ahead log, then "
            f"the database), the database's disk ({directory}) has {_size(free)} free, "
            f"and jobs.minFreeDisk keeps {_size(reserve)} in reserve; "
            "free space there, or retry once running jobs have ended"
        )

    def _forget_body(self, request_id: str) -> None:
        """Delete the body of a job that was not accepted, in the background; if
        the database refuses now, pruning at the next start removes it."""

        async def forget() -> None:
            try:
                await asyncio.to_thread(delete_body, self.engine, request_id)
            except Exception as exc:
                log.warning("the body of refused job %s stays until pruned: %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(forget())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_existing(
        self, send: Send, key: str, existing: tuple[str, str], digest: str, door: str | None
    ) -> None:
        request_id, existing_digest = existing
        if existing_digest != digest:
            await send_error(
                send,
                409,
                f"Idempotency-Key {key!r} was already used for job {request_id} "
                "with a different body",
                code="idempotency_key_reused",
            )
            return
        recording = self._recording.get(request_id)
        if recording is not None and not await asyncio.shield(recording):
            await send_error(
                send,
                503,
                f"job {request_id}, sent with Idempotency-Key {key!r} a moment ago, "
                "could not be recorded; send it again",
                code="event_log_unavailable",
            )
            return
        view = await self.view(request_id) or {"id": request_id}
        await _send_json(send, 200, response_object(view) if door == DOOR else view, request_id)

    # -- running --------------------------------------------------------------

    def run(self, ticket: Ticket, job: dict[str, Any]) -> None:
        """Run a job when its turn comes (also used for jobs recovered at start).
        No task exists until then: 100,000 recovered jobs cost no coroutines."""

        def turn_came(ready: asyncio.Future[str]) -> None:
            credentials = self._credentials.pop(ticket.request_id, {})
            if ready.cancelled() or ready.exception() is not None:
                return  # cancelled, or failed to load: already recorded by the scheduler
            task = asyncio.get_running_loop().create_task(
                self._run(ticket, job, ready.result(), credentials)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.scheduler.supervise(ticket.request_id, task)

        ticket.ready.add_done_callback(turn_came)

    async def _run(
        self, ticket: Ticket, job: dict[str, Any], base_url: str, credentials: dict[str, str]
    ) -> None:
        url = upstream_url(base_url, job["path"], job["query"])
        try:
            body = await self._body(ticket.request_id, job)
        except BodyMissing as exc:
            self.scheduler.failed(ticket.request_id, str(exc), None)
            return
        captured = _Captured()

        async def keep_result() -> None:
            await write_until_accepted(
                lambda: store_result(
                    self.engine,
                    ticket.request_id,
                    captured.status,
                    captured.headers,
                    bytes(captured.body),
                ),
                f"the result of job {ticket.request_id}",
            )

        await self.forwarder.forward(
            job["method"],
            url,
            body,
            dict(job["headers"]) | credentials,
            ticket,
            Reply(captured.send, ticket),
            before_completed=keep_result,
        )

    async def _body(self, request_id: str, job: dict[str, Any]) -> bytes:
        """The job's body: in its event in logs written before job_bodies existed
        (base64), else stored under its id. BodyMissing when it is not there."""
        if "body" in job:
            return base64.b64decode(job["body"])
        return await asyncio.to_thread(
            load_body, self.engine, request_id, job.get("body_bytes"), job.get("body_sha256")
        )

    def prune(self) -> int:
        """Delete results older than jobs.resultRetention (the events stay), and
        bodies no job will read again (`prune_bodies`); returns how many rows."""
        results = prune_results(self.engine, time.time() - self.config.result_retention_s)
        return results + prune_bodies(self.engine, self._started_at)

    async def prune_forever(self, every_s: float = 3600.0) -> None:
        while True:
            try:
                removed = await asyncio.to_thread(self.prune)
                if removed:
                    log.info("pruned %d job results and bodies no longer needed", removed)
            except Exception:
                log.exception("pruning job results failed")
            await asyncio.sleep(every_s)

    # -- reading --------------------------------------------------------------

    async def view(self, request_id: str) -> dict[str, Any] | None:
        """A job's status: the read model, overlaid with live state for open jobs
        (the log commits in groups; the live state is never behind)."""
        row, result = await asyncio.to_thread(job_rows, self.engine, request_id)
        return self._view(request_id, row, result)

    def _view(self, request_id: str, row: Any, result: Any) -> dict[str, Any] | None:
        live = self.scheduler.open_status(request_id)
        if live is None and row is None:
            return None
        out: dict[str, Any] = {"id": request_id, "object": "job"}
        if row is None:
            open_request = self.scheduler.live().state.requests.get(request_id)
            out["caller"] = open_request.caller if open_request is not None else None
        else:
            out.update(
                status=row["status"],
                model=row["model"],
                priority=row["priority"],
                band=row["band"],
                caller=row["caller"],
                attempt=row["attempt"],
                durable=bool(row["durable"]),
                enqueued_at=row["enqueued_at"],
                dispatched_at=row["dispatched_at"],
                started_at=row["started_at"],
                finished_at=row["finished_at"],
                http_status=row["http_status"],
                error=row["error"],
            )
            door = (row["job"] or {}).get("door")
            if door is not None:
                out["door"] = door
        if live is not None:
            out.update(status=live.status, attempt=live.attempt)
            if live.ahead is not None:
                out["position"] = live.ahead
                out["score"] = msgspec.to_builtins(live.score)
        if result is not None:
            out["result"] = {
                "http_status": result["http_status"],
                "headers": dict(json.loads(result["headers"])),
                "body": _body_for_json(result["body"]),
            }
        return out

    async def view_for(self, who: Identity, request_id: str) -> dict[str, Any] | None:
        """The view, or None when there is no such job or it is not `who`'s to see."""
        view = await self.view(request_id)
        if view is None or not may_see(who, view.get("caller")):
            return None
        return view

    async def listing(
        self, status: str | None, limit: int, caller: str | None = None
    ) -> list[dict[str, Any]]:
        """Newest first (only `caller`'s when given), with their results."""
        found = await asyncio.to_thread(list_jobs, self.engine, status, limit, caller)
        views = [self._view(row["id"], row, result) for row, result in found]
        return [v for v in views if v is not None]

    async def cancel(self, who: Identity, request_id: str) -> tuple[int, dict[str, Any]]:
        live = self.scheduler.open_status(request_id)
        view = await self.view_for(who, request_id)
        if view is None:
            return 404, {
                "error": {
                    "message": f"no job {request_id}",
                    "type": "not_found_error",
                    "code": "job_not_found",
                }
            }
        if live is None:
            return 409, {
                "error": {
                    "message": f"job {request_id} is {view['status']}; "
                    "only queued or running jobs can be cancelled",
                    "type": "conflict_error",
                    "code": "job_not_open",
                }
            }
        # A running job is cut off at once: its upstream connection is closed.
        self.scheduler.cancel_any(request_id)
        # Answered once the cancel is on disk, so the next read of the job agrees.
        await self.scheduler.recorded(timeout=5.0)
        after = await self.view(request_id) or view
        # If the store is slow or refusing, the live state has ended it all the same.
        return 200, after | {"status": "cancelled"}


def job_routes(jobs: JobRunner) -> list[BaseRouteHandler]:
    @get("/v1/jobs")
    async def list_jobs(
        request: Request[Any, Any, Any],
        status: FromQuery[str | None] = None,
        limit: FromQuery[int] = 50,
    ) -> Response[Any]:
        allowed = ("queued", "running", "completed", "failed", "cancelled", "abandoned")
        if status is not None and status not in allowed:
            message = f"status {status!r} is not one of {', '.join(allowed)}"
            error = {"message": message, "type": "invalid_request_error", "code": "invalid_status"}
            return Response({"error": error}, status_code=400)
        caller = only_caller(identity(request.scope))
        data = await jobs.listing(status, max(1, min(limit, 1000)), caller)
        return Response({"object": "list", "data": data})

    @get("/v1/jobs/{job_id:str}")
    async def get_job(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        view = await jobs.view_for(identity(request.scope), job_id)
        if view is None:
            return Response(_not_found(job_id), status_code=404)
        return Response(view)

    @get("/v1/jobs/{job_id:str}/result")
    async def get_result(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        # Another caller's job is not found, whether or not it has a result.
        view = await jobs.view_for(identity(request.scope), job_id)
        if view is None:
            return Response(_not_found(job_id), status_code=404)
        found = await asyncio.to_thread(job_result, jobs.engine, job_id)
        if found is None:
            return Response(
                {
                    "error": {
                        "message": f"job {job_id} is {view.get('status')}; no result yet",
                        "type": "conflict_error",
                        "code": "no_result",
                    }
                },
                status_code=409,
            )
        status, headers, body = found
        keep = {k: v for k, v in headers if k.lower() in ("content-type", "content-encoding")}
        return Response(body, status_code=status, headers=keep, media_type=keep.get("content-type"))

    @delete("/v1/jobs/{job_id:str}", status_code=200)
    async def cancel_job(request: Request[Any, Any, Any], job_id: FromPath[str]) -> Response[Any]:
        status, body = await jobs.cancel(identity(request.scope), job_id)
        return Response(body, status_code=status)

    return [list_jobs, get_job, get_result, cancel_job]


def _not_found(job_id: str) -> dict[str, Any]:
    return {
        "error": {"message": f"no job {job_id}", "type": "not_found_error", "code": "job_not_found"}
    }


def _body_for_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        pass
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(body).decode()}


async def _send_json(
    send: Send,
    status: int,
    doc: dict[str, Any],
    request_id: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [
        (b"location", f"/v1/jobs/{request_id}".encode()),
        (b"x-request-id", request_id.encode()),
        *(extra or []),
    ]
    await send_json(send, status, msgspec.json.encode(doc), headers)


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _size(n: int) -> str:
    """Bytes for a person: `60.0 MiB (62914560 bytes)`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
