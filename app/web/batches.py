"""The OpenAI Batch API (`/v1/batches`): a JSONL file of requests run as durable jobs.

One mechanism, another door (docs/jobs.md): each line of the input file becomes
a durable job exactly as `Prefer: respond-async` makes one (its body stored
once in `job_bodies`, its `request_enqueued` on disk before the batch is
acknowledged, run by `JobRunner`, its answer in `job_results`), in the same
queue, attributed to the caller, at batch priority unless asked otherwise. So
the same events, recovery and `explain` hold for every line, and fair share
spreads the GPU between two people's batches.

The batch's own rows (app/store/batches.py) hold what only it decides: its
status once decided (validating, failed, in_progress, cancelling, and the
ends: completed, expired, cancelled), its times and its output files.
Everything else derives from its lines' jobs, so a batch needs no recovery of
its own: after a restart, recovery has put its open lines back in the queue,
and a batch that was still queueing its lines (validating) queues the rest.

`completion_window` is each line's `max_wait_ns` (the scheduler's
X-Gpulane-Max-Wait): a line not started by the batch's `expires_at` is
cancelled (reason `deadline`) and answered in the error file as expired.
A watcher (`watch`) finishes batches whose lines have all ended: it writes the
output and error files and the batch's end in one transaction, so every
custom_id is answered exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
import uuid
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, FromQuery
from sqlalchemy import RowMapping

from app.core.priority import ALIASES, HEADER, grant, read_priority, tier_offset
from app.report.progress import Progress, progress
from app.runtime.admission import Refused
from app.runtime.api import Admission, new_request_id
from app.store.batches import (
    OPEN_BATCH_STATUSES,
    batch_of_request,
    batch_row,
    create_batch,
    finish_batch,
    line_model,
    line_outcomes,
    line_states,
    line_summary,
    list_batches,
    open_batches,
    set_batch,
    set_line_error,
)
from app.store.files import file_content, file_row
from app.store.job_bodies import BodyMissing, load_body
from app.web.access import identity, may_see, only_caller
from app.web.auth import Identity, identify
from app.web.batch_input import (
    BATCH_ENDPOINTS,
    MAX_ERRORS,
    Line,
    LineError,
    completion_window_s,
    read_lines,
)
from app.web.console.security import SECURITY_HEADERS
from app.web.jobs import JobRunner
from app.web.request_body import BadRequest, rewrite

log = logging.getLogger("gpulane.batches")

BATCH_PRIORITY = ALIASES["batch"]
_MAX_REQUEST = 1 << 20
_TRANSIENT = ("event_log_unavailable", "shutting_down")
"""Refusals that say nothing about the line: it is queued later instead."""
WATCH_EVERY_S = 0.5
PROGRESS_MAX_AGE_S = 1.0


class BatchError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "invalid_request_error"),
                "param": param,
                "code": code,
            }
        }


_TYPES = {404: "not_found_error", 409: "conflict_error", 507: "server_error"}


def batch_default(key_default: int) -> int:
    """What a batch line queues at when nothing is asked: the batch band, with
    the key's tier offset (`defaultPriority: batch+2` stays -98); a key whose
    default is lower keeps it."""
    return min(key_default, BATCH_PRIORITY + tier_offset(key_default))


class BatchRunner:
    def __init__(self, jobs: JobRunner) -> None:
        self.jobs = jobs
        self.config = jobs.config
        self.scheduler = jobs.scheduler
        self.engine = jobs.engine
        self._progress: dict[str, tuple[float, Progress | None]] = {}
        """Batch id -> (when, its progress), for `progress`."""
        self._queueing: set[str] = set()
        """Batches whose lines this process is queueing now (the watcher leaves them)."""
        self._wake = asyncio.Event()

    # -- creating ---------------------------------------------------------------

    async def create(self, who: Identity, doc: Any, asked_header: int | None) -> dict[str, Any]:
        if not isinstance(doc, dict):
            raise BatchError(400, "the request body must be a JSON object", "invalid_request")
        endpoint = doc.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise BatchError(
                400,
                f"endpoint {endpoint!r} is not one of {', '.join(BATCH_ENDPOINTS)}",
                "invalid_endpoint",
                "endpoint",
            )
        window = doc.get("completion_window", "24h")
        window_s = completion_window_s(window)
        if window_s is None:
            raise BatchError(
                400,
                f"completion_window {window!r} is not a duration such as '24h', '30m' or "
                "'7d' (at most 366d)",
                "invalid_completion_window",
                "completion_window",
            )
        metadata = doc.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise BatchError(
                400, "metadata must be an object of strings", "invalid_metadata", "metadata"
            )
        asked = asked_header
        if asked is None and metadata and "priority" in metadata:
            asked = read_priority(metadata["priority"])
            if asked is None:
                raise BatchError(
                    400,
                    f"metadata.priority {metadata['priority']!r} is not a priority: an integer "
                    "or interactive, normal, batch",
                    "invalid_priority",
                    "metadata",
                )
        priority = grant(asked, who.max_priority, batch_default(who.default_priority))
        file_id = doc.get("input_file_id")
        found = None
        if isinstance(file_id, str):
            found = await asyncio.to_thread(file_content, self.engine, file_id)
        if found is None or not may_see(who, found[0]["caller"]):
            raise BatchError(404, f"no file {file_id}", "file_not_found", "input_file_id")
        meta, content = found
        if meta["purpose"] != "batch":
            raise BatchError(
                400,
                f"file {file_id} has purpose {meta['purpose']!r}; a batch's input needs 'batch'",
                "invalid_input_file",
                "input_file_id",
            )
        lines, errors = await asyncio.to_thread(
            read_lines, content, endpoint, self.config.resolve_model, self._body
        )
        now = time.time()
        batch = {
            "id": "batch_" + uuid.uuid4().hex,
            "caller": who.caller,
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": window,
            "metadata": metadata,
            "priority": priority,
            "status": "validating",
            "total": len(lines),
            "created_at": now,
            "expires_at": now + window_s,
        }
        if errors:
            batch |= {
                "status": "failed",
                "failed_at": now,
                "errors": _errors(errors),
                "total": 0,
            }
            await asyncio.to_thread(create_batch, self.engine, batch, [], [])
            return await self.view(batch["id"]) or {}
        rows, bodies = _line_rows(batch["id"], lines)
        # The lines' bodies are stored like any durable job's: jobs.minFreeDisk holds.
        short = self.jobs._disk_too_full(sum(len(body) for _, body in bodies))
        if short is not None:
            raise BatchError(507, short, "insufficient_storage")
        # Ours to queue from the moment it is on disk: the watcher, waking in
        # between, would queue it too, reading each line's body back (it found
        # a 10,000-line batch still validating after POST /v1/batches).
        self._queueing.add(batch["id"])
        try:
            await asyncio.to_thread(create_batch, self.engine, batch, rows, bodies)
        except BaseException:
            self._queueing.discard(batch["id"])
            raise
        known = {row["request_id"]: (row["model"], body) for row, body in zip_bodies(rows, bodies)}
        await self._queue(batch["id"], known, reserved=True)
        return await self.view(batch["id"]) or {}

    def _body(self, model: str, doc: dict[str, Any]) -> bytes:
        changed = rewrite(doc, self.config.models[model])
        return json.dumps(changed if changed is not None else doc).encode()

    async def _queue(
        self,
        batch_id: str,
        known: dict[str, tuple[str, bytes]] | None = None,
        *,
        reserved: bool = False,
    ) -> None:
        """Queue the lines of a validating batch that have no job yet, then mark
        it in_progress once every enqueue is on disk. Run at creation (the
        batch `reserved` in `_queueing` before it was stored), and by the
        watcher for a batch a crash left validating."""
        if batch_id in self._queueing and not reserved:
            return
        self._queueing.add(batch_id)
        try:
            batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
            if batch is None or batch["status"] not in ("validating", "in_progress", "cancelling"):
                return
            states = await asyncio.to_thread(line_states, self.engine, batch_id)
            live = self.scheduler.state.requests
            waiting = [
                s
                for s in states
                if s["request_id"] and s["status"] is None and s["request_id"] not in live
            ]
            if batch["status"] == "cancelling":
                for s in waiting:
                    await asyncio.to_thread(
                        set_line_error, self.engine, batch_id, s["line"], _cancelled_error()
                    )
                return
            known = known or {}
            try:
                commits = [
                    await self._queue_line(batch, s, known.get(s["request_id"])) for s in waiting
                ]
                results = await asyncio.gather(
                    *(c for c in commits if c is not None), return_exceptions=True
                )
            finally:
                # A dispatch attempt per line was most of a 10,000-line batch's
                # creation time (docs/benchmarks.md): one for them all instead.
                self.scheduler.pump()
            if any(isinstance(r, BaseException) for r in results):
                log.warning("batch %s: some lines could not be queued yet; retrying", batch_id)
                return
            await asyncio.to_thread(
                set_batch,
                self.engine,
                batch_id,
                ["validating"],
                status="in_progress",
                in_progress_at=time.time(),
            )
        finally:
            self._queueing.discard(batch_id)
            self._wake.set()

    async def _queue_line(
        self, batch: RowMapping, state: RowMapping, known: tuple[str, bytes] | None
    ) -> asyncio.Future[list[int]] | None:
        """Admit one line as a durable job; the future of its enqueue's commit,
        or None when it was answered otherwise (refused: its error is stored)."""
        request_id = state["request_id"]
        if known is not None:
            model, body = known
        else:
            try:
                body = await asyncio.to_thread(load_body, self.engine, request_id)
            except BodyMissing as exc:
                error = {"code": "body_missing", "message": str(exc)}
                await asyncio.to_thread(
                    set_line_error, self.engine, batch["id"], state["line"], error
                )
                return None
            model = await asyncio.to_thread(line_model, self.engine, batch["id"], state["line"])
        job = {
            "method": "POST",
            "path": batch["endpoint"],
            "query": "",
            "headers": {"content-type": "application/json"},
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "batch_id": batch["id"],
            "custom_id": state["custom_id"],
        }
        deadline_ns = int(batch["expires_at"] * 1e9)
        admission = Admission(
            model=model,
            model_requested=model,
            endpoint=batch["endpoint"],
            priority=batch["priority"],
            caller=batch["caller"],
            durable=True,
            job=job,
            max_wait_ns=max(1, deadline_ns - self.scheduler.clock()),
            request_id=request_id,
        )
        try:
            # At creation every line is admitted at once: no dispatch attempt
            # each, one by `_queue` when their enqueues are on disk.
            ticket = self.scheduler.admit(admission, pump=known is None)
        except Refused as exc:
            if exc.code in _TRANSIENT:
                # Not the line's fault: it stays unqueued, and is queued once
                # the log takes writes again (or at the next start).
                retry: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
                retry.set_exception(exc)
                return retry
            self.scheduler.refused(admission, exc)
            error = {"code": exc.code or "refused", "message": str(exc)}
            await asyncio.to_thread(set_line_error, self.engine, batch["id"], state["line"], error)
            return None
        self.jobs.run(ticket, job)
        assert ticket.committed is not None
        return ticket.committed

    # -- watching -----------------------------------------------------------------

    async def watch(self, every_s: float = WATCH_EVERY_S) -> None:
        """Forever: queue what a crash left unqueued, withdraw a cancelled batch's
        waiting lines, finish batches whose lines have all ended."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("watching batches failed; trying again")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), every_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        for batch in await asyncio.to_thread(open_batches, self.engine):
            if batch["id"] in self._queueing:
                continue
            counts = await asyncio.to_thread(line_summary, self.engine, batch["id"])
            if counts["unqueued"]:
                await self._queue(batch["id"])  # leaves lines being committed now
                continue
            if batch["status"] == "cancelling":
                self._withdraw(await asyncio.to_thread(line_states, self.engine, batch["id"]))
            if counts["ended"] == counts["total"]:
                await asyncio.to_thread(self._finish, batch)

    def _withdraw(self, states: list[RowMapping]) -> None:
        """Cancel the lines still waiting; running ones finish."""
        for s in states:
            rid = s["request_id"]
            status = self.scheduler.open_status(rid) if rid else None
            if status is not None and status.status == "queued":
                self.scheduler.cancel_any(rid)

    def _finish(self, batch: RowMapping) -> None:
        outcomes = line_outcomes(self.engine, batch["id"])
        cancelling = batch["status"] == "cancelling"
        output: list[bytes] = []
        errors: list[bytes] = []
        expired = False
        for o in outcomes:
            entry, ok = _answer(o, cancelling)
            expired |= o["cancel_reason"] == "deadline"
            (output if ok else errors).append(json.dumps(entry).encode())
        now = time.time()
        files = []
        values: dict[str, Any] = {"finalizing_at": now}
        for name, rows in (("output", output), ("error", errors)):
            if rows:
                f = file_row(
                    batch["caller"],
                    "batch_output",
                    f"{batch['id']}_{name}.jsonl",
                    b"\n".join(rows) + b"\n",
                )
                files.append(f)
                values[f"{name}_file_id"] = f["id"]
        if cancelling:
            values |= {"status": "cancelled", "cancelled_at": now}
        elif expired:
            values |= {"status": "expired", "expired_at": now}
        else:
            values |= {"status": "completed", "completed_at": now}
        if finish_batch(self.engine, batch["id"], files, **values):
            log.info(
                "batch %s %s: %d answered, %d in its error file",
                batch["id"],
                values["status"],
                len(output),
                len(errors),
            )

    # -- cancelling and reading ---------------------------------------------------

    async def cancel(self, who: Identity, batch_id: str) -> dict[str, Any]:
        batch = await self._owned(who, batch_id)
        if batch["status"] in ("validating", "in_progress"):
            await asyncio.to_thread(
                set_batch,
                self.engine,
                batch_id,
                ["validating", "in_progress"],
                status="cancelling",
                cancelling_at=time.time(),
            )
            states = await asyncio.to_thread(line_states, self.engine, batch_id)
            self._withdraw(states)
            # On disk before the answer, so its counts and the next read agree.
            await self.scheduler.recorded(timeout=5.0)
            self._wake.set()
        elif batch["status"] != "cancelling":
            raise BatchError(
                409,
                f"batch {batch_id} is {batch['status']}; only a validating or in_progress "
                "batch can be cancelled",
                "batch_not_open",
            )
        return await self.view(batch_id) or {}

    async def _owned(self, who: Identity, batch_id: str) -> RowMapping:
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None or not may_see(who, batch["caller"]):
            raise BatchError(404, f"no batch {batch_id}", "batch_not_found")
        return batch

    async def view_for(self, who: Identity, batch_id: str) -> dict[str, Any]:
        batch = await self._owned(who, batch_id)
        view = await self.view(batch_id) or {}
        if view:
            view["gpulane_progress"] = await self._view_progress(batch, view)
        return view

    async def _view_progress(self, batch: RowMapping, view: dict[str, Any]) -> Any:
        """A view's `gpulane_progress`. A batch that has ended needs nothing but
        its counts (no estimate: nothing is open), so a listing of many ended
        batches costs no more than their counts; an open one's is `progress`."""
        counts = view["request_counts"]
        if batch["status"] == "failed" and not batch["total"]:
            return None  # it never queued
        if batch["status"] not in OPEN_BATCH_STATUSES:
            ended = Progress(
                total=counts["total"],
                done=counts["completed"],
                failed=counts["failed"],
                running=0,
                waiting=0,
            )
            return msgspec.to_builtins(ended)
        found = await self.progress(batch["id"], counts["completed"] + counts["failed"])
        return None if found is None else msgspec.to_builtins(found)

    async def runs(self, caller: str | None) -> list[dict[str, Any]]:
        """The open batches (only `caller`'s when given) with their progress, for
        `/api/queue` and `gpulane queue`."""
        out = []
        for batch in await asyncio.to_thread(open_batches, self.engine):
            if caller is None or batch["caller"] == caller:
                out.append(await self._run(batch))
        return out

    async def run_of(self, request_id: str) -> dict[str, Any] | None:
        """The batch a job is a line of, with its progress (for explain), or None."""
        batch_id = await asyncio.to_thread(batch_of_request, self.engine, request_id)
        if batch_id is None:
            return None
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        return None if batch is None else await self._run(batch)

    async def _run(self, batch: RowMapping) -> dict[str, Any]:
        found = await self.progress(batch["id"])
        return {
            "id": batch["id"],
            "object": "batch",
            "caller": batch["caller"],
            "status": batch["status"],
            "metadata": batch["metadata"],
            "progress": None if found is None else msgspec.to_builtins(found),
        }

    def line_status(self, row: RowMapping) -> str:
        """A line's status as of now: its job's (live when open), `unqueued`, or
        `refused` (answered without a job: its model, or the queue's bounds)."""
        rid = row["request_id"]
        live = self.scheduler.open_status(rid) if rid is not None else None
        if live is not None:
            return live.status
        if row["status"] is not None:
            return str(row["status"])
        return "refused" if row["line_error"] is not None else "unqueued"

    async def progress(self, batch_id: str, ended: int | None = None) -> Progress | None:
        """Its lines done, running, waiting and failed, and an estimated finish
        (app/report/progress.py); None for a batch that never queued (failed).
        Kept for `PROGRESS_MAX_AGE_S`: the estimate walks the queue up to the
        batch's last line on the event loop (about 50 ms at 10,000 lines);
        with `ended` (its lines ended, as the caller read them), only while
        that count is the cached one's."""
        now = time.monotonic()
        cached = self._progress.get(batch_id)
        if cached is not None and now - cached[0] < PROGRESS_MAX_AGE_S:
            found = cached[1]
            if ended is None or found is None or found.done + found.failed == ended:
                return found
        found = await self._compute_progress(batch_id)
        self._progress = {
            k: v for k, v in self._progress.items() if now - v[0] < PROGRESS_MAX_AGE_S
        }
        self._progress[batch_id] = (now, found)
        return found

    async def _compute_progress(self, batch_id: str) -> Progress | None:
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None or batch["status"] == "failed" and not batch["total"]:
            return None
        states = await asyncio.to_thread(line_states, self.engine, batch_id)
        times = self.scheduler.durations()  # learnt as each line ends: the queue's own
        live = self.scheduler.live()
        done = failed = 0
        open_ids: list[str] = []
        unqueued: list[str] = []
        for s in states:
            rid = s["request_id"]
            if rid is not None and rid in live.state.requests:
                open_ids.append(rid)
            elif rid is not None and s["status"] is None and s["line_error"] is None:
                unqueued.append(s["model"] or "")
            elif s["status"] in ("queued", "running"):
                done += 1  # ended a moment ago; the log's group commit is on its way
            elif s["status"] == "completed" and 200 <= (s["http_status"] or 0) < 300:
                done += 1
            else:
                failed += 1
        if batch["status"] in ("completed", "expired", "cancelled", "cancelling"):
            unqueued = []  # nothing more will be queued
        return progress(
            live.state,
            live.running_since,
            live.now_ns,
            times,
            open_ids,
            done=done,
            failed=failed,
            unqueued_models=unqueued,
        )

    async def view(self, batch_id: str) -> dict[str, Any] | None:
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None:
            return None
        counts = await asyncio.to_thread(line_summary, self.engine, batch_id)
        return self._view(batch, counts)

    def _view(self, batch: RowMapping, counts: dict[str, int]) -> dict[str, Any]:
        total, ended = counts["total"], counts["ended"]
        status = batch["status"]
        if status == "in_progress" and total and ended == total:
            status = "finalizing"  # its files are being written

        def at(name: str) -> int | None:
            value = batch[name]
            return None if value is None else int(value)

        return {
            "id": batch["id"],
            "object": "batch",
            "endpoint": batch["endpoint"],
            "errors": batch["errors"],
            "input_file_id": batch["input_file_id"],
            "completion_window": batch["completion_window"],
            "status": status,
            "output_file_id": batch["output_file_id"],
            "error_file_id": batch["error_file_id"],
            "created_at": int(batch["created_at"]),
            "in_progress_at": at("in_progress_at"),
            "expires_at": at("expires_at"),
            "finalizing_at": at("finalizing_at"),
            "completed_at": at("completed_at"),
            "failed_at": at("failed_at"),
            "expired_at": at("expired_at"),
            "cancelling_at": at("cancelling_at"),
            "cancelled_at": at("cancelled_at"),
            "request_counts": {
                "total": total,
                "completed": counts["succeeded"],
                "failed": ended - counts["succeeded"],
            },
            "metadata": batch["metadata"],
            "priority": batch["priority"],
            "caller": batch["caller"],
        }

    async def listing(
        self, who: Identity, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        rows, more = await asyncio.to_thread(
            list_batches, self.engine, only_caller(who), limit, after
        )
        views = []
        for row in rows:
            counts = await asyncio.to_thread(line_summary, self.engine, row["id"])
            view = self._view(row, counts)
            view["gpulane_progress"] = await self._view_progress(row, view)
            views.append(view)
        return views, more


def batch_routes(runner: BatchRunner) -> list[BaseRouteHandler]:
    @post("/v1/batches", status_code=200)
    async def create(request: Request[Any, Any, Any]) -> Response[Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            who = identify(request.scope, headers)
            raw = await request.body()
            if len(raw) > _MAX_REQUEST:
                raise BatchError(413, "the request body is too large", "request_too_large")
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                raise BatchError(400, f"the body is not JSON: {exc}", "invalid_json") from None
            return Response(
                await runner.create(who, doc, read_priority(headers.get(HEADER.lower())))
            )
        except BadRequest as exc:
            return Response(
                {
                    "error": {
                        "message": exc.message,
                        "type": "invalid_request_error",
                        "code": exc.code,
                    }
                },
                status_code=exc.status,
            )
        except BatchError as exc:
            return Response(exc.body, status_code=exc.status)

    @get("/v1/batches")
    async def listing(
        request: Request[Any, Any, Any],
        limit: FromQuery[int] = 20,
        after: FromQuery[str | None] = None,
    ) -> Response[Any]:
        data, more = await runner.listing(identity(request.scope), max(1, min(limit, 100)), after)
        return Response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    @get("/v1/batches/{batch_id:str}")
    async def retrieve(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
        try:
            return Response(await runner.view_for(identity(request.scope), batch_id))
        except BatchError as exc:
            return Response(exc.body, status_code=exc.status)

    @post("/v1/batches/{batch_id:str}/cancel", status_code=200)
    async def cancel(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[Any]:
        try:
            return Response(await runner.cancel(identity(request.scope), batch_id))
        except BatchError as exc:
            return Response(exc.body, status_code=exc.status)

    @get("/ui/api/batches/{batch_id:str}/lines", response_headers=SECURITY_HEADERS)
    async def lines(
        request: Request[Any, Any, Any],
        batch_id: FromPath[str],
        offset: FromQuery[int] = 0,
        limit: FromQuery[int] = 200,
    ) -> Response[Any]:
        """A page of the batch's lines with their jobs' status, for the console's batch page."""
        try:
            batch = await runner._owned(identity(request.scope), batch_id)
        except BatchError as exc:
            return Response(exc.body, status_code=exc.status)
        offset, limit = max(0, min(offset, 2**62)), max(1, min(limit, 1000))
        rows = await asyncio.to_thread(line_states, runner.engine, batch_id, offset, limit)
        data = [
            {
                "line": r["line"],
                "custom_id": r["custom_id"],
                "model": r["model"],
                "request_id": r["request_id"],
                "status": runner.line_status(r),
                "error": (r["line_error"] or {}).get("message") or r["error"],
            }
            for r in rows
        ]
        return Response({"data": data, "offset": offset, "total": batch["total"]})

    return [create, listing, retrieve, cancel, lines]


# -- lines ---------------------------------------------------------------------


def _line_rows(
    batch_id: str, lines: list[Line]
) -> tuple[list[dict[str, Any]], list[tuple[str, bytes]]]:
    rows = []
    bodies = []
    for line in lines:
        row: dict[str, Any] = {
            "batch_id": batch_id,
            "line": line.line,
            "custom_id": line.custom_id,
            "model": line.model,
            "request_id": None,
            "error": None,
        }
        if line.model is None:
            row["error"] = {
                "code": "model_not_found",
                "message": f"line {line.line}: model {line.model_requested!r} is not configured",
            }
        else:
            row["request_id"] = new_request_id()
            bodies.append((row["request_id"], line.body))
        rows.append(row)
    return rows, bodies


def zip_bodies(
    rows: list[dict[str, Any]], bodies: list[tuple[str, bytes]]
) -> list[tuple[dict[str, Any], bytes]]:
    by_id = dict(bodies)
    return [(row, by_id[row["request_id"]]) for row in rows if row["request_id"] in by_id]


def _errors(errors: list[LineError]) -> dict[str, Any]:
    data = [msgspec.to_builtins(e) for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        data.append(
            {
                "code": "too_many_errors",
                "message": f"{len(errors) - MAX_ERRORS} more errors not listed",
                "line": None,
                "param": None,
            }
        )
    return {"object": "list", "data": data}


def _cancelled_error() -> dict[str, Any]:
    return {"code": "batch_cancelled", "message": "the batch was cancelled before this line ran"}


def _answer(o: RowMapping, cancelling: bool) -> tuple[dict[str, Any], bool]:
    """A line's entry in the output (True) or error file (False), in OpenAI's shape."""
    rid = o["request_id"]
    entry: dict[str, Any] = {
        "id": f"batch_req_{rid or o['line']}",
        "custom_id": o["custom_id"],
        "response": None,
        "error": None,
    }
    if rid is None:
        entry["error"] = o["line_error"]
        return entry, False
    status = o["status"]
    if status == "completed":
        if o["result_status"] is None:
            entry["error"] = {
                "code": "result_pruned",
                "message": f"job {rid}'s answer is no longer kept (jobs.resultRetention)",
            }
            return entry, False
        entry["response"] = {
            "status_code": o["result_status"],
            "request_id": rid,
            "body": _body(o["result_body"]),
        }
        return entry, 200 <= o["result_status"] < 300
    if status == "cancelled" and o["cancel_reason"] == "deadline":
        entry["error"] = {
            "code": "batch_expired",
            "message": "this request could not be run before the batch's completion window ended",
        }
    elif status == "cancelled" and cancelling:
        entry["error"] = _cancelled_error()
    else:
        message = o["error"] or f"job {rid} ended {status}"
        if status == "cancelled":
            message = f"job {rid} was cancelled ({o['cancel_reason']})"
        entry["error"] = {"code": f"request_{status}", "message": message}
    return entry, False


def _body(body: bytes | None) -> Any:
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        pass
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(body).decode()}
