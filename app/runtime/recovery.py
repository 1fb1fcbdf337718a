"""Start-up recovery: close what a previous process left open.

Only open requests and unstopped processes are read (from the read models),
so recovery costs time in proportion to what was open, not to the log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.core import events as ev
from app.runtime.scheduler import Scheduler
from app.runtime.upstream import kill_process_group, process_matches
from app.store.event_store import open_processes, open_requests

log = logging.getLogger("gpulane.recovery")


async def recover(scheduler: Scheduler, engine: Any) -> ev.RecoveryFinished:
    counts = {"abandoned": 0, "processes_stopped": 0, "processes_left": 0}
    events: list[ev.AnyEvent] = []
    for proc in open_processes(engine):
        cmdline = list(proc.cmdline)
        if process_matches(proc.pid, cmdline):
            # A crash must never leave a model holding GPU memory.
            await asyncio.to_thread(kill_process_group, proc.pid, 10.0)
            counts["processes_stopped"] += 1
        else:
            # Gone already, or the PID now belongs to someone else: leave it alone.
            counts["processes_left"] += 1
        events.append(
            ev.ProcessStopped(at=scheduler.clock(), model=proc.model, pid=proc.pid, reason="recovered")
        )
    for row in open_requests(engine):
        # Synchronous clients vanished with the previous process.
        events.append(ev.RequestAbandoned(at=scheduler.clock(), request_id=row.id))
        counts["abandoned"] += 1
    summary = ev.RecoveryFinished(at=scheduler.clock(), **counts)
    scheduler.emit([*events, summary])
    if any(counts.values()):
        log.info(
            "recovery: %d requests abandoned, %d upstream processes stopped, %d left alone",
            counts["abandoned"],
            counts["processes_stopped"],
            counts["processes_left"],
        )
    return summary
