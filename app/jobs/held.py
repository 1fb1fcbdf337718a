"""Jobs that run in the background on their server: a render.

ComfyUI answers `POST /prompt` at once and renders for minutes after; to the
proxy that is a short request, after which the GPU looks idle. A held job's
request therefore does not end when the HTTP answer does: its sender submits
the job, then asks the server's probe until the probe reports its end (done,
refused, failed, interrupted), and only that end is recorded. Until then the
request runs, so its model is busy: it is not evicted, TTL does not stop it,
and (a held model runs one job at a time, `SchedulerState.slots`) nothing else
runs on it. One rule, the same for every kind of server: how the end is learnt
is the probe's (one per kind: `Probe`), that the job holds its model until then
is the core's.

The time limits stay the scheduler's: `maxRunTime` (from the hand-over), an
operator's cancel or unload (the job is put back and sent again), a stop. When
the scheduler takes the request away (`Ticket.detached`) the sender stops asking
and tells the server to drop the job (`Probe.interrupt`, best effort).

A probe that also learns how far the job is (`ReportsProgress`: a render's
steps done of steps) is asked once a second while the job runs, and the sender
records it (`request_progressed`), sampled: when it moved by `PROGRESS_STEP`
since the last record, or changed and `PROGRESS_EVERY_S` passed. The running
job's expected end follows it (app/core/start_estimate.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import msgspec

from app.jobs.durable import KeepResult
from app.runtime.api import Ticket
from app.runtime.scheduler import Scheduler

log = logging.getLogger("gpulane.jobs")

INTERRUPT_TIMEOUT_S = 5.0
"""How long a best-effort interrupt may take once the scheduler took a job away."""
PROGRESS_CHECK_S = 1.0
"""Between two looks at a running job's progress."""
PROGRESS_STEP = 0.1
PROGRESS_EVERY_S = 30.0
"""A job's progress is recorded when it moved by a tenth since the last record,
or changed at all and this long passed: a 20-minute render makes a few dozen
events, not one per step."""


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """A held job's end, as its probe learnt it."""

    ok: bool
    status: int | None
    """What the request's terminal event records (200 done; the server's refusal;
    None where no HTTP status says it)."""
    error: str | None = None
    """Why it failed, naming the server's own words."""
    result: bytes = b""
    """What is kept as the job's result (ComfyUI: its history entry), served
    after the server was swapped out."""


class ProbeLost(Exception):
    """The server stopped answering about the job (it crashed, or it dropped the
    job): the job has ended without an end the server reported."""


class Probe(Protocol):
    """How the end of a held job is learnt from one kind of server."""

    async def finished(self, base_url: str, job_id: str) -> Verdict | None:
        """The job's end if the server already has it (a job sent again after a
        crash or an unload that the server finished anyway); None otherwise."""
        ...

    async def submit(self, base_url: str, job: dict[str, Any], body: bytes) -> Verdict | None:
        """Hand the job to the server: None once it accepted it, the verdict when
        it refused it."""
        ...

    async def wait(self, base_url: str, job_id: str) -> Verdict:
        """Until the job ends on the server; ProbeLost when the server stops
        answering about it."""
        ...

    async def interrupt(self, base_url: str, job_id: str) -> None:
        """Drop the job on the server, waiting or running."""
        ...


@runtime_checkable
class ReportsProgress(Protocol):
    """A probe that also learns how far a running job is."""

    def progress(self, job_id: str) -> tuple[int, int] | None:
        """(done, total) as the server last said, None before it said anything."""
        ...


class _Sampler:
    """Which of a job's progress readings are recorded."""

    def __init__(self, now: float) -> None:
        self.last: tuple[int, int] | None = None
        self.last_at = now

    def due(self, seen: tuple[int, int], now: float) -> bool:
        done, total = seen
        if total <= 0 or seen == self.last:
            return False
        before = 0.0 if self.last is None else self.last[0] / self.last[1]
        moved = round(abs(done / total - before), 9)  # 0.3 - 0.2 is a tenth here
        if moved < PROGRESS_STEP and now - self.last_at < PROGRESS_EVERY_S:
            return False
        self.last, self.last_at = seen, now
        return True


class HeldRuns:
    """The sender of held jobs (`Upstream` of app/jobs/durable.py), one probe
    per kind of server, keyed by the job's door."""

    def __init__(self, scheduler: Scheduler, probes: Mapping[str, Probe]) -> None:
        self.scheduler = scheduler
        self.probes = dict(probes)

    def holds(self, job: dict[str, Any]) -> bool:
        return job.get("door") in self.probes

    async def send(
        self, ticket: Ticket, base_url: str, job: dict[str, Any], body: bytes, keep: KeepResult
    ) -> None:
        rid = ticket.request_id
        probe = self.probes[job["door"]]
        self.scheduler.started(rid)
        t0 = time.monotonic()
        work = asyncio.ensure_future(_until_end(probe, rid, base_url, job, body))
        either: set[asyncio.Future[Any]] = {work, ticket.detached}
        # runtime_checkable only sees that an attribute named `progress` exists.
        reports = probe if isinstance(probe, ReportsProgress) and callable(probe.progress) else None
        sampler = _Sampler(t0)
        try:
            while not (work.done() or ticket.detached.done()):
                await asyncio.wait(
                    either,
                    timeout=PROGRESS_CHECK_S if reports is not None else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                seen = reports.progress(rid) if reports is not None else None
                if seen is not None and not work.done() and sampler.due(seen, time.monotonic()):
                    self.scheduler.progressed(rid, *seen)
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            # Taken away (cancel, unload, maxRunTime, shutdown): the server drops it too.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(probe.interrupt(base_url, rid), INTERRUPT_TIMEOUT_S)
            return
        exc = work.exception()
        if isinstance(exc, ProbeLost):
            self.scheduler.failed(rid, str(exc), 502)
            return
        if exc is not None:
            raise exc
        verdict = work.result()
        if verdict.result:
            kind = [("content-type", "application/json")]
            await keep(verdict.status or 500, kind, verdict.result)
        if verdict.ok:
            run_ms = (time.monotonic() - t0) * 1000
            self.scheduler.completed(rid, verdict.status or 200, run_ms=run_ms)
        else:
            self.scheduler.failed(rid, verdict.error or "the job failed", verdict.status)


async def _until_end(
    probe: Probe, job_id: str, base_url: str, job: dict[str, Any], body: bytes
) -> Verdict:
    done = await probe.finished(base_url, job_id)
    if done is not None:
        log.info("job %s: the server had finished it already; its result is taken", job_id)
        return done
    refused = await probe.submit(base_url, job, body)
    if refused is not None:
        return refused
    return await probe.wait(base_url, job_id)
