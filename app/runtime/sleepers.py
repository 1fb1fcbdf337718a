"""Model servers put to sleep instead of stopped, and woken instead of started.

A model whose config has `sleep` (app/config/sleep.py) is evicted by its sleep
calls: its process keeps running, out of `Processes`' table, and its GPU memory
is free. Its next load wakes it instead of starting a process. Each step is
recorded (`process_sleeping`, `process_slept`, `process_woken`); a sleep or a
wake that fails or runs past its bound is recorded (`sleep_skipped`) and falls
back to what gpulane did before: the process is stopped, and after a wake a
new one is cold-started. The host memory sleepers hold together is bounded by
`sleepHostMemory` (`app.core.sleep_budget`). A sleeper's TTL, an unload and
shutdown stop it (`Swaps.stop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Literal, Protocol

import httpx
import msgspec

from app.config import Config, ModelConfig
from app.config.sleep import HttpCall, SleepSpec
from app.core import events as ev
from app.core.sleep_budget import Sleeper, describe, make_room
from app.runtime.processes import Processes, Upstream

log = logging.getLogger("gpulane.scheduler")

CHECK_EVERY = 0.05
"""Seconds between two asks of a server's sleep check."""


class Asleep(msgspec.Struct):
    proc: Upstream
    spec: SleepSpec
    proxy: str
    since_ns: int


class SleepError(Exception):
    """A sleep or wake call the server did not answer as it should."""


class _Memory(Protocol):
    def stopping(self, model: str, proc: Upstream | None) -> None: ...


class Owner(Protocol):
    """What `Sleepers` needs of `Swaps`."""

    config: Config
    memory: _Memory
    """Loads wait for a stopped process's GPU memory (app/runtime/memory_release.py)."""

    def spec(self, model: str) -> ModelConfig: ...
    def stop(self, model: str, reason: ev.StopReason) -> None: ...
    def record(self, events: Iterable[ev.AnyEvent]) -> None: ...
    def arm_ttl(self, model: str) -> None: ...


class Sleepers:
    def __init__(self, swaps: Owner, processes: Processes, clock: Callable[[], int]) -> None:
        self._swaps = swaps
        self._processes = processes
        self._clock = clock
        self.asleep: dict[str, Asleep] = {}
        self._client: httpx.AsyncClient | None = None
        """One client for every sleep and wake call: making one costs tens of ms of CPU."""
        processes.wake = self.wake

    def __contains__(self, model: str) -> bool:
        return model in self.asleep

    def models(self) -> list[str]:
        """The models asleep, in the order they fell asleep."""
        return list(self.asleep)

    def take(self, model: str) -> Upstream | None:
        """Forget `model`'s sleeping process and hand it over (to be stopped)."""
        asleep = self.asleep.pop(model, None)
        return None if asleep is None else asleep.proc

    def forget(self, model: str, proc: Upstream) -> None:
        """`proc` exited by itself (a crash): it sleeps no more."""
        asleep = self.asleep.get(model)
        if asleep is not None and asleep.proc is proc:
            del self.asleep[model]

    # -- sleep ------------------------------------------------------------------

    def evict(self, model: str, evicted_for: str, evicted_by: str | None) -> bool:
        """Put `model` to sleep instead of stopping it, if its config says how and
        the host-memory budget has room (stopping the longest-asleep sleepers
        first); False: the caller stops it."""
        spec = self._swaps.spec(model)
        proc = self._processes.get(model)
        if spec.sleep is None or proc is None or not proc.running:
            return False
        now = self._clock()
        room = make_room(
            spec.sleep.host_memory,
            [Sleeper(m, a.spec.host_memory, a.since_ns) for m, a in self.asleep.items()],
            self._swaps.config.sleep_host_memory,
        )
        if not room.sleep:
            budget = self._swaps.config.sleep_host_memory or 0
            why = (
                f"its hostMemory {describe(spec.sleep.host_memory)} is more than "
                f"sleepHostMemory {describe(budget)}"
            )
            self._record(
                ev.SleepSkipped(at=now, model=model, pid=proc.pid, action="sleep", why=why)
            )
            return False
        for other in room.stop:
            log.info("stopping sleeping %s: host memory for sleepers is needed", other)
            self._swaps.stop(other, "host_memory")
        self._record(
            ev.ProcessSleeping(
                at=now, model=model, pid=proc.pid, evicted_for=evicted_for, evicted_by=evicted_by
            )
        )
        log.info("putting %s to sleep (evicted for %s)", model, evicted_for)
        sleep, proxy = spec.sleep, spec.proxy

        async def work(proc: Upstream) -> None:
            await self._sleep(model, proc, sleep, proxy, evicted_for, evicted_by)

        self._processes.put_aside(model, work)
        return True

    async def _sleep(
        self,
        model: str,
        proc: Upstream,
        spec: SleepSpec,
        proxy: str,
        evicted_for: str,
        evicted_by: str | None,
    ) -> None:
        t0 = self._clock()
        try:
            calls = _call_all(self._http(), proxy, spec.sleep, spec.check, True, spec.idle)
            await asyncio.wait_for(calls, spec.sleep_timeout)
        except (TimeoutError, Exception) as exc:
            why = _why(exc, "sleep", spec.sleep_timeout)
            log.warning("sleeping %s failed (%s): stopping it instead", model, why)
            self._failed(model, proc, "sleep", why, t0)
            await self._stop(model, proc, "evicted", evicted_for, evicted_by)
            return
        if not proc.running:
            return  # it died meanwhile: its watcher records the crash
        now = self._clock()
        self.asleep[model] = Asleep(proc=proc, spec=spec, proxy=proxy, since_ns=now)
        assert proc.pid is not None
        self._record(
            ev.ProcessSlept(
                at=now,
                model=model,
                pid=proc.pid,
                duration_ms=(now - t0) / 1e6,
                host_memory=spec.host_memory,
            )
        )
        log.info("%s is asleep (%.2f s)", model, (now - t0) / 1e9)
        self._swaps.arm_ttl(model)  # a sleeper's TTL stops it

    # -- wake -------------------------------------------------------------------

    async def wake(self, spec: ModelConfig) -> Upstream | None:
        """Wake `spec`'s sleeping server (Processes asks before it starts one): its
        process, or None when none sleeps or its wake failed (then it is stopped
        here, recorded, and the load cold-starts a new one)."""
        asleep = self.asleep.pop(spec.id, None)
        if asleep is None or not asleep.proc.running:
            return None
        model, proc, sleep = spec.id, asleep.proc, asleep.spec
        t0 = self._clock()
        try:
            await asyncio.wait_for(
                _call_all(self._http(), asleep.proxy, sleep.wake, sleep.check, False),
                sleep.wake_timeout,
            )
        except (TimeoutError, Exception) as exc:
            why = _why(exc, "wake", sleep.wake_timeout)
            log.warning("waking %s failed (%s): stopping it for a cold start", model, why)
            self._failed(model, proc, "wake", why, t0)
            await self._stop(model, proc, "wake_failed", None, None)
            return None
        now = self._clock()
        assert proc.pid is not None
        self._record(
            ev.ProcessWoken(at=now, model=model, pid=proc.pid, duration_ms=(now - t0) / 1e6)
        )
        log.info("%s is awake (%.2f s)", model, (now - t0) / 1e9)
        return proc

    # -- helpers ----------------------------------------------------------------

    def _failed(
        self, model: str, proc: Upstream, action: Literal["sleep", "wake"], why: str, t0: int
    ) -> None:
        """Record a sleep or wake call that failed `why`, begun at `t0` (the
        caller then stops `proc`)."""
        self._record(
            ev.SleepSkipped(
                at=self._clock(),
                model=model,
                pid=proc.pid,
                action=action,
                why=why,
                duration_ms=(self._clock() - t0) / 1e6,
            )
        )

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None)
        return self._client

    async def close(self) -> None:
        """Close the client of the sleep and wake calls (at shutdown)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _stop(
        self,
        model: str,
        proc: Upstream,
        reason: ev.StopReason,
        evicted_for: str | None,
        evicted_by: str | None,
    ) -> None:
        """Stop a process that is out of `Processes`' table, recorded as a stop is."""
        self._swaps.memory.stopping(model, proc)  # the next load waits for its memory
        t0 = self._clock()
        self._record(
            ev.ProcessStopping(
                at=t0,
                model=model,
                pid=proc.pid,
                reason=reason,
                evicted_for=evicted_for,
                evicted_by=evicted_by,
            )
        )
        code = await proc.stop()
        if proc.pid is not None:
            now = self._clock()
            self._record(
                ev.ProcessStopped(
                    at=now,
                    model=model,
                    pid=proc.pid,
                    reason=reason,
                    exit_code=code,
                    evicted_for=evicted_for,
                    evicted_by=evicted_by,
                    duration_ms=(now - t0) / 1e6,
                )
            )

    def _record(self, event: ev.AnyEvent) -> None:
        self._swaps.record([event])


async def _call_all(
    client: httpx.AsyncClient,
    proxy: str,
    calls: Iterable[HttpCall],
    check: HttpCall | None,
    asleep: bool,
    idle: HttpCall | None = None,
) -> None:
    """Send `calls` to the server at `proxy` in order (each must answer 2xx), then
    ask `idle` until nothing is queued or running there (ComfyUI frees memory
    between prompts), and `check` until it says `is_sleeping` is `asleep`. The
    caller bounds the whole."""
    for call in calls:
        answer = await client.request(call.method, proxy + call.path, json=call.body)
        if not answer.is_success:
            raise SleepError(f"{call} answered {answer.status_code}: {answer.text[:200]}")
    while idle is not None:
        answer = await client.request(idle.method, proxy + idle.path)
        if answer.is_success:
            try:
                doc = answer.json()
                if not doc["queue_running"] and not doc["queue_pending"]:
                    break
            except (ValueError, KeyError, TypeError):
                raise SleepError(f"{idle} answered {answer.text[:200]!r}") from None
        await asyncio.sleep(CHECK_EVERY)
    if check is None:
        return
    while True:
        answer = await client.request(check.method, proxy + check.path)
        if answer.is_success:
            try:
                if answer.json().get("is_sleeping") is asleep:
                    return
            except (ValueError, AttributeError):
                raise SleepError(f"{check} answered {answer.text[:200]!r}") from None
        await asyncio.sleep(CHECK_EVERY)


def _why(exc: BaseException, action: str, bound: float) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return f"the {action} took more than its {bound:g} s"
    if isinstance(exc, httpx.HTTPError):
        return f"the {action} call failed: {type(exc).__name__}: {exc}"
    return str(exc) or type(exc).__name__
