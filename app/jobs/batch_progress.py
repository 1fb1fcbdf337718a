"""A batch's progress as its callers and the console read it: its lines done,
running, waiting and failed, and an estimated finish (app/report/progress.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from sqlalchemy import Engine, RowMapping

from app.report.progress import Progress, ended_well, progress
from app.runtime.scheduler import Scheduler
from app.store.batches import (
    OPEN_BATCH_STATUSES,
    batch_of_request,
    batch_row,
    line_states,
    open_batches,
)

PROGRESS_MAX_AGE_S = 1.0


class BatchProgress:
    def __init__(self, scheduler: Scheduler, engine: Engine) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self._progress: dict[str, tuple[float, Progress | None]] = {}
        """Batch id -> (when, its progress), for `progress`."""

    async def of_counts(self, batch: RowMapping, counts: dict[str, int]) -> Any:
        """A batch's `gpulane_progress`, given its lines' counts (`line_summary`).
        A batch that has ended needs nothing but its counts (no estimate: nothing
        is open), so a listing of many ended batches costs no more than their
        counts; an open one's is `progress`."""
        if batch["status"] == "failed" and not batch["total"]:
            return None  # it never queued
        succeeded, failed = counts["succeeded"], counts["ended"] - counts["succeeded"]
        if batch["status"] not in OPEN_BATCH_STATUSES:
            ended = Progress(
                total=counts["total"], done=succeeded, failed=failed, running=0, waiting=0
            )
            return msgspec.to_builtins(ended)
        found = await self.progress(batch["id"], succeeded + failed)
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
        found = await self._compute(batch_id)
        self._progress = {
            k: v for k, v in self._progress.items() if now - v[0] < PROGRESS_MAX_AGE_S
        }
        self._progress[batch_id] = (now, found)
        return found

    async def _compute(self, batch_id: str) -> Progress | None:
        batch = await asyncio.to_thread(batch_row, self.engine, batch_id)
        if batch is None or batch["status"] == "failed" and not batch["total"]:
            return None
        states = await asyncio.to_thread(line_states, self.engine, batch_id)
        times = self.scheduler.durations()  # learnt as each line ends: the queue's own
        # One snapshot for the count and the estimate: they agree on what is open.
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
            elif s["status"] is not None and ended_well(s["status"], s["http_status"]):
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
            history=self.scheduler.lane_history,
        )
