"""What the end of a model's load means for the requests waiting on it: they
run, or they fail, or a peer's request goes to another peer (a part of
`Scheduler`, app/runtime/scheduler.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.core import events as ev
from app.core.peers import another_peer_left
from app.core.policy import given_up
from app.core.run_estimate import RunEstimates
from app.core.state import SchedulerState
from app.runtime.api import Detached, Ticket
from app.runtime.out_of_memory import failed_load_status
from app.runtime.swaps import Swaps
from app.runtime.upstream import UpstreamStartError

log = logging.getLogger("gpulane.scheduler")


class LoadOutcomes:
    """`load_ended` and what follows (mixed into `Scheduler`)."""

    state: SchedulerState
    clock: Callable[[], int]
    swaps: Swaps
    tickets: dict[str, Ticket]
    run_estimates: RunEstimates

    if TYPE_CHECKING:

        def emit(self, events: Any) -> asyncio.Future[list[int]]:
            raise NotImplementedError

        def pump(self) -> None:
            raise NotImplementedError

        def _end(self, event: ev.AnyEvent, detach: Detached | None = None) -> bool:
            raise NotImplementedError

        def _release(self, request_id: str, model: str) -> None:
            raise NotImplementedError

    def load_ended(
        self,
        model: str,
        error: str | None,
        seconds: float,
        gpu_memory_mib: int | None = None,
        out_of_memory: str | None = None,
    ) -> None:
        """The load of `model` ended (`error`: how it failed; `out_of_memory`: its
        server's line saying the GPU ran out of memory): record it, then release
        the requests that waited for it, or fail them (or send them to another
        peer). Out of memory, they fail with 503 (`upstream_out_of_memory`): the
        GPU is full, not the server broken, so a later try may load it."""
        now = self.clock()
        waiting = [rid for rid, m in self.state.running.items() if m == model]
        if error is None:
            log.info("%s is ready (loaded in %.1f s)", model, seconds)
            woke = model in self.state.waking  # until the swap_finished below
            finished = ev.SwapFinished(
                at=now, model=model, duration_ms=seconds * 1000, gpu_memory_mib=gpu_memory_mib
            )
            self.emit([finished])
            self.run_estimates.observe_load(model, int(seconds * 1e9), woke=woke)
            for rid in waiting:
                self._release(rid, model)
            self.swaps.arm_ttl(model)
        else:
            log.warning("loading %s failed: %s", model, error)
            failed = ev.SwapFailed(
                at=now,
                model=model,
                error=error,
                duration_ms=seconds * 1000,
                out_of_memory=out_of_memory,
            )
            self.emit([failed])
            status = failed_load_status(out_of_memory)
            for rid in waiting:
                if self._retry_on_another_peer(rid, model, error):
                    continue
                ticket = self.tickets.get(rid)
                if ticket is not None and not ticket.ready.done():
                    ticket.ready.set_exception(
                        UpstreamStartError(error, out_of_memory=out_of_memory)
                    )
                self._end(ev.RequestFailed(at=now, request_id=rid, error=error, http_status=status))
            self._after_failed_load(model, error, now, out_of_memory)
        self.pump()

    def _after_failed_load(
        self, model: str, error: str, now: int, out_of_memory: str | None = None
    ) -> None:
        """A load of `model` failed at `now` (recorded): at `loadFailureLimit`
        failures in a row its waiting requests fail with the loader's error
        (`given_up`); else they wait out its back-off, and a timer pumps when it ends."""
        failures = self.state.load_failures[model]
        doomed = given_up(self.state, model)
        if doomed:
            message = (
                f"model {model!r} failed to load {failures.count} times in a row "
                f"(loadFailureLimit {self.state.load_backoff.failure_limit}); "
                f"the last load failed: {error}"
            )
            log.warning("%s: failing its %d waiting requests", message, len(doomed))
            for rid in doomed:
                ticket = self.tickets.get(rid)
                if ticket is not None and not ticket.ready.done():
                    ticket.ready.set_exception(
                        UpstreamStartError(message, out_of_memory=out_of_memory)
                    )
                status = failed_load_status(out_of_memory)
                self._end(
                    ev.RequestFailed(at=now, request_id=rid, error=message, http_status=status)
                )
        self.swaps.arm_backoff(model)

    def _retry_on_another_peer(self, request_id: str, model: str, error: str) -> bool:
        """A peer did not answer the probe for a request several peers may serve:
        put it back in the queue (recorded), so the next decision sends it to
        another peer (`peers.another_peer_left`); False when none is left."""
        request = self.state.requests.get(request_id)
        if request is None or model == request.model:
            return False
        choices = self.state.choices.get(request.model, ())
        if not another_peer_left(choices, model, self.state.load_failures.keys()):
            return False
        log.warning("request %s: %s; retrying it on another peer", request_id, error)
        self.emit(
            [ev.RequestRequeued(at=self.clock(), request_id=request_id, attempt=request.attempt)]
        )
        return True
