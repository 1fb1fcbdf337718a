"""Start-up recovery: close what a previous process left open.

Only open requests and unstopped processes are read (from the read models and
their enqueue events), so recovery costs time in proportion to what was open,
not to the length of the log.

Everything recovery does to the queue is an event, in one batch: a
`request_restored` per durable job put back, in arrival order (one that was
running followed at once by its `request_requeued`, so it keeps its arrival
place on ties), `request_abandoned` or `request_failed` for the rest, then
`recovery_finished`. The state it leaves is
therefore the fold of the whole log (`app.core.state`), which is what `explain`
and `replay --verify` rebuild.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

import msgspec

from app.core import events as ev
from app.runtime.api import Ticket
from app.runtime.process_table import env_entry, marked, signal_procs, wait_gone
from app.runtime.scheduler import Scheduler
from app.runtime.upstream import (
    find_group_leaders,
    kill_process_group,
    owner_marker,
    process_matches,
)
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
    ours = owner_marker(scheduler.owner) if scheduler.owner else None
    for pid, cmdline in await asyncio.to_thread(find_group_leaders, list(by_cmd)):
        if pid in recorded:
            continue
        if ours is not None and env_entry(pid, ours) is None:
            # The same argv, not started by this gpulane: a placeholder cmd beside
            # a server started elsewhere (`sleep infinity`) may well run elsewhere too.
            continue
        await asyncio.to_thread(kill_process_group, pid, 10.0)
        counts["processes_stopped"] += 1
        events.append(
            ev.ProcessStopped(
                at=scheduler.clock(), model=by_cmd[cmdline], pid=pid, reason="recovered"
            )
        )
    # What an upstream spawned into a new session escapes both searches above;
    # it still carries this server's marker in its environment.
    if scheduler.owner:  # no owner (tests): its marker would match others' upstreams
        counts["processes_stopped"] += await _stop_marked(owner_marker(scheduler.owner))
    jobs: list[tuple[Ticket, dict[str, Any]]] = []
    # Restoring allocates a few objects per job and frees none: with the cyclic
    # GC on, its full collections rescan everything restored so far, which was
    # half the time with 100,000 jobs (bench/recovery_bench.py).
    gc_enabled = gc.isenabled()
    gc.collect()  # nothing collectable is left to be frozen below
    gc.disable()
    try:
        _restore(scheduler, engine, max_attempts, counts, events, jobs)
        summary = ev.RecoveryFinished(at=scheduler.clock(), **counts)
        # Applying the restores is what builds the queue: also with the GC paused.
        scheduler.emit([*events, summary])
    finally:
        if gc_enabled:
            if len(jobs) >= _FREEZE_FROM:
                # What is restored lives until its job ends: keep it out of later
                # full collections too (it is still freed by reference counting).
                gc.freeze()
            gc.enable()
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


async def _stop_marked(prefix: bytes) -> int:
    """SIGTERM, then SIGKILL, every process carrying PREFIX; returns how many."""
    found = left = await asyncio.to_thread(marked, prefix)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not left:
            break
        signal_procs(left, sig)
        left = await wait_gone(left, wait)
    return len(found)


def _restore(
    scheduler: Scheduler,
    engine: Any,
    max_attempts: int,
    counts: dict[str, int],
    events: list[ev.AnyEvent],
    jobs: list[tuple[Ticket, dict[str, Any]]],
) -> None:
    """Appends to `events`, in arrival order: each synchronous open request
    abandoned, each durable one failed past its attempts or restored, and a
    restored one that was running re-queued right after its restore (attempt
    + 1). Its queue order is then its arrival order among the restored jobs, so
    equal scores keep arrival order with aging off too (an older recovery
    re-queued them after all the rest, and logs it wrote still fold so)."""
    requeued = 0
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
        restored = ev.RequestRestored(
            at=now,
            request_id=row.id,
            model=enqueued.model,
            priority=enqueued.priority,
            # Aging continues from the original enqueue time.
            enqueued_at=enqueued.enqueued_at if enqueued.enqueued_at is not None else enqueued.at,
            attempt=row.attempt,
            caller=enqueued.caller,
            expected_run_ns=enqueued.expected_run_ns,
            max_wait_ns=enqueued.max_wait_ns,
            endpoint=enqueued.endpoint,
        )
        events.append(restored)
        if row.status == "running":
            events.append(ev.RequestRequeued(at=now, request_id=row.id, attempt=row.attempt + 1))
            requeued += 1
        jobs.append((scheduler.restore(restored, enqueued.endpoint), enqueued.job or {}))
        if (enqueued.job or {}).get("batch_id"):
            scheduler.batch_lines.add(enqueued.caller, row.id)
    counts["requeued"] += requeued
    counts["resumed"] += len(jobs) - requeued
