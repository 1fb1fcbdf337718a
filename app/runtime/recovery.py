"""Start-up recovery: close what a previous process left open.

Only open requests and unstopped processes are read (from the read models and
their enqueue events), so recovery costs time in proportion to what was open,
not to the length of the log.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import msgspec

from app.core import events as ev
from app.runtime.scheduler import Scheduler, Ticket
from app.runtime.upstream import find_group_leaders, kill_process_group, process_matches
from app.store.event_store import open_processes
from app.store.queries import open_enqueues

log = logging.getLogger("gpulane.recovery")

_FREEZE_FROM = 1000
"""Restored jobs from which gc.freeze() pays (it is process-wide; servers only)."""


class Recovered(msgspec.Struct):
    summary: ev.RecoveryFinished
    jobs: list[tuple[Ticket, dict[str, Any]]]
    """Durable jobs back in the queue, to be run when their turn comes."""


async def recover(scheduler: Scheduler, engine: Any, max_attempts: int) -> Recovered:
    counts = dict.fromkeys(
        ("requeued", "resumed", "abandoned", "failed", "processes_stopped", "processes_left"), 0
    )
    events: list[ev.AnyEvent] = []
    for proc in open_processes(engine):
        if process_matches(proc.pid, list(proc.cmdline)):
            # Stop it before anything new starts: a crash never leaves a model holding the GPU.
            await asyncio.to_thread(kill_process_group, proc.pid, 10.0)
            counts["processes_stopped"] += 1
        else:
            # Gone already, or the PID now belongs to someone else: leave it alone.
            counts["processes_left"] += 1
        events.append(
            ev.ProcessStopped(
                at=scheduler.clock(), model=proc.model, pid=proc.pid, reason="recovered"
            )
        )
    # Started in the instant before a crash, so never recorded: found by command line.
    recorded = {proc.pid for proc in open_processes(engine)}
    by_cmd = {tuple(spec.cmd): spec.id for spec in scheduler.config.models.values()}
    for pid, cmdline in await asyncio.to_thread(find_group_leaders, list(by_cmd)):
        if pid in recorded:
            continue
        await asyncio.to_thread(kill_process_group, pid, 10.0)
        counts["processes_stopped"] += 1
        events.append(
            ev.ProcessStopped(
                at=scheduler.clock(), model=by_cmd[cmdline], pid=pid, reason="recovered"
            )
        )
    jobs: list[tuple[Ticket, dict[str, Any]]] = []
    # Restoring allocates a few objects per job and frees none: with the cyclic
    # GC on, its full collections rescan everything restored so far, which was
    # half the time with 100,000 jobs (bench/recovery_bench.py).
    gc_enabled = gc.isenabled()
    gc.collect()  # nothing collectable is left to be frozen below
    gc.disable()
    try:
        _restore(scheduler, engine, max_attempts, counts, events, jobs)
    finally:
        if gc_enabled:
            if len(jobs) >= _FREEZE_FROM:
                # What is restored lives until its job ends: keep it out of later
                # full collections too (it is still freed by reference counting).
                gc.freeze()
            gc.enable()
    summary = ev.RecoveryFinished(at=scheduler.clock(), **counts)
    scheduler.emit([*events, summary])
    if any(counts.values()):
        log.info(
            "recovery: %d jobs resumed, %d re-queued, %d failed after max attempts, "
            "%d requests abandoned, %d upstream processes stopped, %d left alone",
            counts["resumed"],
            counts["requeued"],
            counts["failed"],
            counts["abandoned"],
            counts["processes_stopped"],
            counts["processes_left"],
        )
    return Recovered(summary=summary, jobs=jobs)


def _restore(
    scheduler: Scheduler,
    engine: Any,
    max_attempts: int,
    counts: dict[str, int],
    events: list[ev.AnyEvent],
    jobs: list[tuple[Ticket, dict[str, Any]]],
) -> None:
    """Durable open requests back into the scheduler; synchronous ones abandoned."""
    for row, data in open_enqueues(engine):
        now = scheduler.clock()
        if not row.durable:
            # A synchronous client vanished with the previous process.
            events.append(ev.RequestAbandoned(at=now, request_id=row.id))
            counts["abandoned"] += 1
            continue
        enqueued = ev.decode(data)
        assert isinstance(enqueued, ev.RequestEnqueued)
        if row.status == "running" and row.attempt >= max_attempts:
            events.append(
                ev.RequestFailed(
                    at=now,
                    request_id=row.id,
                    error=f"was running when gpulane stopped, {row.attempt} times "
                    f"(jobs.maxAttempts is {max_attempts})",
                )
            )
            counts["failed"] += 1
            continue
        # Aging continues from the original enqueue time.
        original = enqueued.enqueued_at if enqueued.enqueued_at is not None else enqueued.at
        ticket = scheduler.restore(
            msgspec.structs.replace(enqueued, attempt=row.attempt, enqueued_at=original)
        )
        if row.status == "running":
            events.append(ev.RequestRequeued(at=now, request_id=row.id, attempt=row.attempt + 1))
            counts["requeued"] += 1
        else:
            counts["resumed"] += 1
        jobs.append((ticket, enqueued.job or {}))
