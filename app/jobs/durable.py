"""Durable jobs: requests that survive a restart, whichever door they came through.

The body is stored once, as bytes (app/store/job_bodies.py), and then the
enqueue event, carrying the rest of what is needed to run the request again
(method, path, headers, the body's length and sha256), is on disk before the
door acknowledges it. A body that would leave the database's disk with less
than `jobs.minFreeDisk` free is refused (`NoSpace`). The job then waits its
turn like any request; when dispatched, the service sends it upstream
(`Upstream`) and stores the answer in `job_results` before recording the
completion, so a completed job always has its result; its body goes with its
terminal event. An idempotency key belongs to the caller that sent it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from sqlalchemy import Connection, Engine

from app.config import Config
from app.config.callers import CREDENTIAL_HEADERS
from app.jobs.errors import Conflict, NoSpace, NotFound, OverCap, Unavailable
from app.jobs.job_view import job_view, seen_by
from app.jobs.reserve import disk_shortfall
from app.jobs.stored_bytes import (
    StoredBytes,
    check_headers,
    check_key,
    over_cap_message,
    stored_size,
)
from app.runtime.admission import Refused
from app.runtime.api import Admission, Ticket, new_request_id
from app.runtime.scheduler import Scheduler
from app.store.engine import describe
from app.store.event_store import write_until_accepted
from app.store.job_bodies import BodyMissing, delete_body, load_body, prune_bodies, store_body
from app.store.job_results import (
    StoredResult,
    find_idempotency_key,
    job_result,
    job_rows,
    list_jobs,
    prune_results,
    store_result,
)
from app.store.port import StoreError

log = logging.getLogger("gpulane.jobs")

_OURS = frozenset({"prefer", "idempotency-key"})
"""Headers that are gpulane's to honour, not the upstream's."""

KeepResult = Callable[[int, list[tuple[str, str]], bytes], Awaitable[None]]
"""Stores a job's answer (status, headers, body) before its completion is recorded."""


class Sender(Protocol):
    """Sends a dispatched job to its model's server, calling `keep` with the
    answer to store before its end is recorded."""

    async def send(
        self, ticket: Ticket, base_url: str, job: dict[str, Any], body: bytes, keep: KeepResult
    ) -> None: ...


class Upstream(Sender, Protocol):
    """Sends a dispatched job to its model's server (app/web/jobs.py, over the
    proxy's Forwarder), calling `keep` with the whole answer before the
    completion is recorded."""

    connection_headers: frozenset[str]
    """Headers that concern one connection, not the request: never replayed."""


class JobRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request to keep and run later, as a door hands it over."""

    method: str
    path: str
    query: str
    body: bytes
    headers: dict[str, str]
    """All of the request's headers, names in lower case. Its Idempotency-Key
    names the job for its caller; credentials its model passes
    (`passCredentials`) are kept in memory only, until the job runs; the
    rest, but the connection's, is replayed upstream."""
    door: str | None = None
    """Another door's shape for the answers (`background`: app/web/responses.py),
    or a held job's (`comfyui`: sent by `senders[door]`, app/jobs/held.py)."""
    request_id: str | None = None
    """The id the job is to have (a ComfyUI prompt's `prompt_id`); None: a new one."""
    meta: dict[str, Any] | None = None
    """What its door keeps with the job to describe it later (a video's prompt,
    size, seconds: app/web/videos_routes.py); in the enqueue event, never sent."""


class Accepted(msgspec.Struct, frozen=True):
    """A job accepted now (`fresh`), or the one its idempotency key names."""

    request_id: str
    view: dict[str, Any]
    fresh: bool


class Jobs:
    def __init__(
        self, config: Config, scheduler: Scheduler, engine: Engine, upstream: Upstream
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.engine = engine
        self.upstream = upstream
        # Credentials never reach the log, nor what only concerns gpulane.
        self._not_replayed = upstream.connection_headers | _OURS | CREDENTIAL_HEADERS
        self._keys: dict[tuple[str | None, str], tuple[str, str]] = {}
        """(caller, idempotency key) -> (id, body digest) of the jobs admitted by
        this process. Kept for
        the process's life: a key is then found here or, from earlier runs, on
        disk, with no window between the two (a few hundred bytes per job)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._recording: dict[str, asyncio.Future[bool]] = {}
        """Jobs whose body and enqueue are being written -> whether they were:
        a request with the same Idempotency-Key waits for it before it answers."""
        self._started_at = time.time()
        """Bodies without a request stored before this are left over by an
        earlier process (its enqueue never reached the disk): pruned."""
        self.fence: Callable[[Connection], None] | None = None
        """Checks the server lease in a result's transaction (serve sets it): a
        leader that was taken over stores no result (app/runtime/leadership.py)."""
        self.stored = StoredBytes(
            lambda rid: rid in scheduler.state.requests or rid in self._recording
        )
        """Bytes each caller's open jobs hold (jobs.maxStoredBytesPerCaller)."""
        self._credentials: dict[str, dict[str, str]] = {}
        """Credential headers a job's model passes (`passCredentials`), kept in
        memory only until the job runs: never in the log, so a job run after a
        restart goes without them."""
        self.senders: dict[str, Sender] = {}
        """Door -> the sender of its jobs where not `upstream` (held jobs: a render
        holds its model until its end is learnt, app/jobs/held.py)."""
        # A job an unload puts back while it runs is sent again on a fresh ticket.
        scheduler.on_put_back(self.run)

    # -- accepting ------------------------------------------------------------

    async def accept(self, admission: Admission, request: JobRequest) -> Accepted:
        """Admit a durable job once it is on disk, or find the one its key names.
        Refused (the queue's bounds), NoSpace, Unavailable or Conflict (a key
        reused with another body) when there is no such job; Invalid,
        HeaderTooLarge or OverCap for bytes over a limit (app/jobs/stored_bytes.py)."""
        body = request.body
        # Hashing tens of MiB takes a while; hashlib lets go of the GIL meanwhile.
        digest = await asyncio.to_thread(_sha256, body) if len(body) > 1 << 20 else _sha256(body)
        headers = request.headers
        key = headers.get("idempotency-key") or None
        check_key(key)
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
                return await self._existing(key, existing, digest)
        short = self.why_no_room(len(body))
        if short is not None:
            refusal = Refused(short, status=507, code="insufficient_storage", reason="disk_reserve")
            rid = self.scheduler.refused(admission, refusal)
            raise NoSpace(short, "insufficient_storage", recorded_as=rid)
        stored_headers = {k: v for k, v in headers.items() if k not in self._not_replayed}
        check_headers(stored_headers)
        request_id = request.request_id or new_request_id()
        # The body is not in the job: it is stored once, as bytes, under the job's id.
        job: dict[str, Any] = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "headers": stored_headers,
            "body_bytes": len(body),
            "body_sha256": digest,
        }
        size = stored_size(job, key)
        over = self.why_over_cap(admission.caller, size)
        if over is not None:
            refusal = Refused(over, status=429, code="caller_storage_full")
            rid = self.scheduler.refused(admission, refusal)
            raise OverCap(over, "caller_storage_full", recorded_as=rid)
        if request.door is not None:
            job["door"] = request.door
        if request.meta is not None:
            job["meta"] = request.meta
        admission = msgspec.structs.replace(
            admission, durable=True, idempotency_key=key, job=job, request_id=request_id
        )
        passed = self.config.models[admission.model].pass_credentials
        credentials = {k: v for k, v in headers.items() if k in CREDENTIAL_HEADERS and k in passed}
        # Reserved before the first await, so no concurrent POST takes the key too;
        # such a POST answers once this one is on disk (or is not: `_existing`).
        if key is not None:
            self._keys[scoped] = (request_id, digest)
        self.stored.add(admission.caller, request_id, size)
        recorded = asyncio.get_running_loop().create_future()
        self._recording[request_id] = recorded
        ticket = None
        try:
            ticket = await self._record(admission, body, credentials)
        finally:
            del self._recording[request_id]
            recorded.set_result(ticket is not None)
            if ticket is None:
                self.stored.remove(admission.caller, request_id)
                if key is not None:
                    self._keys.pop(scoped, None)
        assert ticket is not None  # else `_record` raised
        self.run(ticket, job)
        # Without its place: that walks the queue (app/runtime/places.py), and a
        # submission must not cost more as the queue grows.
        view = await self.view(ticket.request_id, place=False) or {"id": ticket.request_id}
        return Accepted(ticket.request_id, view, fresh=True)

    async def _record(
        self, admission: Admission, body: bytes, credentials: dict[str, str]
    ) -> Ticket:
        """Store the body, then queue the job and wait for its enqueue to be on
        disk: its ticket; when refused, the body is deleted and the refusal raised."""
        assert admission.request_id is not None
        request_id = admission.request_id
        try:
            await asyncio.to_thread(store_body, self.engine, request_id, body)
        except Exception as exc:
            self._forget_body(request_id)
            if "full" in str(exc):
                # SQLITE_FULL: the disk filled up under the reserve's check.
                message = f"the job's body could not be stored: {describe(exc)}"
                raise NoSpace(message, "insufficient_storage") from None
            message = f"the job could not be recorded: {describe(exc)}"
            raise Unavailable(message, "event_log_unavailable") from None
        try:
            ticket = self.scheduler.admit(admission)
        except Refused as exc:
            self._forget_body(request_id)
            self.scheduler.refused(admission, exc)
            raise
        if credentials:
            self._credentials[request_id] = credentials
        try:
            assert ticket.committed is not None
            await asyncio.shield(ticket.committed)
        except StoreError as exc:
            # Not on disk, so not accepted: the scheduler has taken it back out.
            self._credentials.pop(request_id, None)
            self._forget_body(request_id)
            message = f"the job could not be recorded: {exc}"
            raise Unavailable(message, "event_log_unavailable") from None
        return ticket

    def why_no_room(self, size: int) -> str | None:
        """Why `size` bytes of job bodies may not be stored now (jobs.minFreeDisk), or None."""
        return disk_shortfall(self.engine, self.config.min_free_disk, size, "this job: its body")

    def why_over_cap(self, caller: str | None, size: int) -> str | None:
        """Why `size` more bytes may not be stored for `caller` now
        (jobs.maxStoredBytesPerCaller), or None."""
        cap = self.config.max_stored_bytes_per_caller
        if self.stored.fits(caller, size, cap):
            return None
        return over_cap_message(caller, self.stored.held(caller), size, cap)

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

    async def _existing(self, key: str, existing: tuple[str, str], digest: str) -> Accepted:
        request_id, existing_digest = existing
        if existing_digest != digest:
            raise Conflict(
                f"Idempotency-Key {key!r} was already used for job {request_id} "
                "with a different body",
                "idempotency_key_reused",
            )
        recording = self._recording.get(request_id)
        if recording is not None and not await asyncio.shield(recording):
            raise Unavailable(
                f"job {request_id}, sent with Idempotency-Key {key!r} a moment ago, "
                "could not be recorded; send it again",
                "event_log_unavailable",
            )
        view = await self.view(request_id, place=False) or {"id": request_id}
        return Accepted(request_id, view, fresh=False)

    # -- running --------------------------------------------------------------

    def run(self, ticket: Ticket, job: dict[str, Any]) -> None:
        """Run a job when its turn comes (also used for jobs recovered at start).
        No task exists until then: 100,000 recovered jobs cost no coroutines."""
        ticket.job = job
        open_request = self.scheduler.state.requests.get(ticket.request_id)
        if open_request is not None and not self.stored.knows(
            ticket.request_id, open_request.caller
        ):
            # Recovered at start, or a batch's line: counted against its caller too.
            self.stored.add(open_request.caller, ticket.request_id, stored_size(job))

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
        try:
            body = await self._body(ticket.request_id, job)
        except BodyMissing as exc:
            self.scheduler.failed(ticket.request_id, str(exc), None)
            return

        async def keep(status: int, headers: list[tuple[str, str]], answer: bytes) -> None:
            await write_until_accepted(
                lambda: store_result(
                    self.engine, ticket.request_id, status, headers, answer, self.fence
                ),
                f"the result of job {ticket.request_id}",
            )

        sent = job if not credentials else job | {"headers": dict(job["headers"]) | credentials}
        sender = self.senders.get(job.get("door") or "", self.upstream)
        await sender.send(ticket, base_url, sent, body, keep)

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

    async def view(self, request_id: str, *, place: bool = True) -> dict[str, Any] | None:
        """A job's status (app/jobs/job_view.py), or None when there is no such job;
        with `place`, a waiting job's place in the queue too (`Scheduler.ahead`)."""
        row, result = await asyncio.to_thread(job_rows, self.engine, request_id)
        return await self._view(request_id, row, result, place=place)

    async def _view(
        self, request_id: str, row: Any, result: Any, *, place: bool = True
    ) -> dict[str, Any] | None:
        live = self.scheduler.open_status(request_id)
        caller = None
        if row is None and live is not None:
            open_request = self.scheduler.live().state.requests.get(request_id)
            caller = open_request.caller if open_request is not None else None
        ahead = None
        if place and live is not None and live.status == "queued":
            ahead = await self.scheduler.ahead(request_id)
        return job_view(request_id, row, result, live, caller, ahead)

    async def view_for(
        self, only: str | None, request_id: str, *, place: bool = True
    ) -> dict[str, Any] | None:
        """The view (`view`), or None when there is no such job or it is not for a
        viewer who sees `only` that caller's jobs (None: everyone's) to see."""
        view = await self.view(request_id, place=place)
        if view is None or not seen_by(only, view.get("caller")):
            return None
        return view

    async def listing(
        self, status: str | None, limit: int, caller: str | None = None
    ) -> list[dict[str, Any]]:
        """Newest first (only `caller`'s when given), with their results."""
        found = await asyncio.to_thread(list_jobs, self.engine, status, limit, caller)
        views = [await self._view(row["id"], row, result) for row, result in found]
        return [v for v in views if v is not None]

    async def result(self, only: str | None, request_id: str) -> StoredResult:
        """The job's stored answer; NotFound (another caller's job too, whether or
        not it has one), Conflict while it has none."""
        view = await self.view_for(only, request_id, place=False)
        if view is None:
            raise NotFound(f"no job {request_id}", "job_not_found")
        found = await asyncio.to_thread(job_result, self.engine, request_id)
        if found is None:
            raise Conflict(f"job {request_id} is {view.get('status')}; no result yet", "no_result")
        return found

    async def cancel(self, only: str | None, request_id: str) -> dict[str, Any]:
        """Cancel an open job; its view once the cancel is on disk. NotFound, or
        Conflict for a job that has ended."""
        live = self.scheduler.open_status(request_id)
        view = await self.view_for(only, request_id, place=False)
        if view is None:
            raise NotFound(f"no job {request_id}", "job_not_found")
        if live is None:
            raise Conflict(
                f"job {request_id} is {view['status']}; "
                "only queued or running jobs can be cancelled",
                "job_not_open",
            )
        # A running job is cut off at once: its upstream connection is closed.
        self.scheduler.cancel_any(request_id)
        # Answered once the cancel is on disk, so the next read of the job agrees.
        await self.scheduler.recorded(timeout=5.0)
        after = await self.view(request_id) or view
        # If the store is slow or refusing, the live state has ended it all the same.
        return after | {"status": "cancelled"}


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()
