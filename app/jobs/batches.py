"""The OpenAI Batch API's lifecycle: a JSONL file of requests run as durable jobs.

One mechanism, another door (docs/jobs.md): each line of the input file becomes
a durable job exactly as `Prefer: respond-async` makes one (its body stored
once in `job_bodies`, its `request_enqueued` on disk before the batch is
acknowledged, run by `Jobs`, its answer in `job_results`), in the same
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
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from sqlalchemy import RowMapping

from app.core.priority import ALIASES, tier_offset
from app.jobs.batch_files import answer, cancelled_error, validation_errors
from app.jobs.batch_input import Line, read_lines
from app.jobs.batch_progress import BatchProgress
from app.jobs.durable import Jobs
from app.jobs.errors import Conflict, Invalid, NoSpace, NotFound, OverCap
from app.jobs.job_view import seen_by
from app.jobs.videos import ENDPOINT as VIDEOS_ENDPOINT
from app.jobs.videos import batch_line as video_line
from app.runtime.admission import Refused
from app.runtime.api import Admission, new_request_id
from app.store.batches import (
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

log = logging.getLogger("gpulane.batches")

BATCH_PRIORITY = ALIASES["batch"]
_TRANSIENT = ("event_log_unavailable", "shutting_down")
"""Refusals that say nothing about the line: it is queued later instead."""
WATCH_EVERY_S = 0.5

EncodeLine = Callable[[str, dict[str, Any]], bytes]
"""A line's body as its model's settings send it upstream (useModelName, filters)."""


def batch_default(key_default: int) -> int:
    """What a batch line queues at when nothing is asked: the batch band, with
    the key's tier offset (`defaultPriority: batch+2` stays -98); a key whose
    default is lower keeps it."""
    return min(key_default, BATCH_PRIORITY + tier_offset(key_default))


class BatchOrder(msgspec.Struct, frozen=True, kw_only=True):
    """A batch as the door read it (endpoint, window and priority checked)."""

    caller: str | None
    only: str | None
    """Whose files the caller sees (app/web/access.py `only_caller`; None: all)."""
    endpoint: str
    input_file_id: Any
    completion_window: str
    window_s: int
    metadata: dict[str, str] | None
    priority: int


class BatchState(msgspec.Struct, frozen=True):
    """A batch's row (app/store/batches.py) and its lines' counts (`line_summary`)."""

    batch: Any
    counts: dict[str, int]


class Batches:
    def __init__(self, jobs: Jobs, encode_line: EncodeLine) -> None:
        self.jobs = jobs
        self.config = jobs.config
        self.scheduler = jobs.scheduler
        self.engine = jobs.engine
        self.encode_line = encode_line
        self.progress = BatchProgress(jobs.scheduler, jobs.engine)
        self._queueing: set[str] = set()
        """Batches whose lines this process is queueing now (the watcher leaves them)."""
        self._wake = asyncio.Event()

    # -- creating ---------------------------------------------------------------

    async def create(self, order: BatchOrder) -> BatchState:
        """Store the batch and queue its lines; a file that fails validation makes
        a failed batch. NotFound, Invalid (not a batch file), NoSpace."""
        file_id = order.input_file_id
        found = None
        if isinstance(file_id, str):
            found = await asyncio.to_thread(file_content, self.engine, file_id)
        if found is None or not seen_by(order.only, found[0]["caller"]):
            raise NotFound(f"no file {file_id}", "file_not_found", "input_file_id")
        meta, content = found
        if meta["purpose"] != "batch":
            raise Invalid(
                f"file {file_id} has purpose {meta['purpose']!r}; a batch's input needs 'batch'",
                "invalid_input_file",
                "input_file_id",
            )
        lines, errors = await asyncio.to_thread(
            read_lines, content, order.endpoint, self.config.resolve_model, self.encode_line
        )
        now = time.time()
        batch = {
            "id": "batch_" + uuid.uuid4().hex,
            "caller": order.caller,
            "endpoint": order.endpoint,
            "input_file_id": file_id,
            "completion_window": order.completion_window,
            "metadata": order.metadata,
            "priority": order.priority,
            "status": "validating",
            "total": len(lines),
            "created_at": now,
            "expires_at": now + order.window_s,
        }
        if errors:
            batch |= {
                "status": "failed",
                "failed_at": now,
                "errors": validation_errors(errors),
                "total": 0,
            }
            await asyncio.to_thread(create_batch, self.engine, batch, [], [])
            return await self._state(batch["id"])
        rows, bodies = _line_rows(batch["id"], lines)
        # The lines' bodies are stored like any durable job's: jobs.minFreeDisk holds.
        size = sum(len(body) for _, body in bodies)
        short = self.jobs.why_no_room(size)
        if short is not None:
            raise NoSpace(short, "insufficient_storage")
        over = self.jobs.why_over_cap(order.caller, size)
        if over is not None:
            raise OverCap(over, "caller_storage_full")
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
        return await self._state(batch["id"])

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
            waiting = [
                s
                for s in states
                if s["request_id"]
                and s["status"] is None
                and self.scheduler.open_status(s["request_id"]) is None
            ]
            if batch["status"] == "cancelling":
                for s in waiting:
                    await asyncio.to_thread(
                        set_line_error, self.engine, batch_id, s["line"], cancelled_error()
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
        if batch["endpoint"] == VIDEOS_ENDPOINT:
            # A video line is held until its server says it ended (app/jobs/videos.py).
            job |= video_line(self.jobs.config, model, request_id, body)
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
            entry, ok = answer(o, cancelling)
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

    async def cancel(self, only: str | None, batch_id: str) -> BatchState:
        """Stop queueing and withdraw the waiting lines (running ones finish);
        answered once that is on disk. NotFound, Conflict for an ended batch."""
        batch = await self.batch_seen_by(only, batch_id)
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
            raise Conflict(
                f"batch {batch_id} is {batch['status']}; only a validating or in_progress "
                "batch can be cancelled",
                "batch_not_open",
            )
        return await self._state(batch_id)

    async def batch_seen_by(self, only: str | None, batch_id: str) -> RowMapping:
        """The batch's row, for a viewer who sees `only` that caller's batches
        (None: everyone's); NotFound when there is none for them."""
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None or not seen_by(only, batch["caller"]):
            raise NotFound(f"no batch {batch_id}", "batch_not_found")
        return batch

    async def state_seen_by(self, only: str | None, batch_id: str) -> BatchState:
        await self.batch_seen_by(only, batch_id)
        return await self._state(batch_id)

    async def _state(self, batch_id: str) -> BatchState:
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None:
            raise NotFound(f"no batch {batch_id}", "batch_not_found")
        counts = await asyncio.to_thread(line_summary, self.engine, batch_id)
        return BatchState(batch, counts)

    async def listing(
        self, only: str | None, limit: int, after: str | None
    ) -> tuple[list[BatchState], bool]:
        rows, more = await asyncio.to_thread(list_batches, self.engine, only, limit, after)
        states = []
        for row in rows:
            counts = await asyncio.to_thread(line_summary, self.engine, row["id"])
            states.append(BatchState(row, counts))
        return states, more

    async def lines(
        self, only: str | None, batch_id: str, offset: int, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """A page of the batch's lines with their jobs' status now, and how many
        lines it has (the console's batch page). NotFound as `batch_seen_by`."""
        batch = await self.batch_seen_by(only, batch_id)
        rows = await asyncio.to_thread(line_states, self.engine, batch_id, offset, limit)
        data = [
            {
                "line": r["line"],
                "custom_id": r["custom_id"],
                "model": r["model"],
                "request_id": r["request_id"],
                "status": self.line_status(r),
                "error": (r["line_error"] or {}).get("message") or r["error"],
            }
            for r in rows
        ]
        return data, batch["total"]

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
