"""The server process behind one model: start it, wait until healthy, stop it.

Each upstream runs in its own session (so its own process group): stopping
signals the whole group, so helpers it spawned cannot outlive it and hold
GPU memory. Process exit is observed through the subprocess protocol rather
than ``Process.wait()``, which on Python 3.11 also waits for the output pipe to
close and so would hang while any escaped grandchild keeps it open.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import httpx

from app.runtime.log_buffer import LogBuffer

_HEALTH_POLL_INTERVAL = 0.075
_GROUP_POLL_INTERVAL = 0.05
_OUTPUT_TAIL_LINES = 30
_OUTPUT_DRAIN_TIMEOUT = 0.5  # after exit, for the last lines still in the pipe
_KILL_WAIT = 5.0  # SIGKILL cannot be ignored, but teardown can take a moment
_MAX_LINE_BYTES = 64 * 1024  # a longer line without a newline is logged in pieces
_PID_MACRO = "${PID}"


class UpstreamSpec(Protocol):
    """What process management needs from a resolved model config."""

    @property
    def id(self) -> str: ...
    @property
    def cmd(self) -> Sequence[str]: ...
    @property
    def cmd_stop(self) -> Sequence[str] | None: ...
    @property
    def proxy(self) -> str: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def check_endpoint(self) -> str | None: ...
    @property
    def unload_timeout(self) -> float: ...


class UpstreamStartError(Exception):
    """The upstream could not be started; the message ends with its last output."""

    def __init__(
        self,
        reason: str,
        *,
        model_id: str | None = None,
        exit_code: int | None = None,
        output: Sequence[str] = (),
    ) -> None:
        self.reason = reason
        self.model_id = model_id
        self.exit_code = exit_code  # None when it did not exit by itself
        self.output = list(output)
        message = reason if model_id is None else f"upstream {model_id}: {reason}"
        if self.output:
            message += "\nlast output:\n" + "\n".join(self.output)
        super().__init__(message)


class _OutputProtocol(asyncio.SubprocessProtocol):
    """Splits a child's merged stdout/stderr into lines and notes its exit."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.output_closed: asyncio.Future[None] = loop.create_future()
        self._on_line = on_line
        self._transport: asyncio.SubprocessTransport | None = None
        self._partial = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Duck-typed: uvloop's process transport is no asyncio.SubprocessTransport
        # subclass, though it has the same methods.
        self._transport = cast(asyncio.SubprocessTransport, transport)

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        *complete, self._partial = (self._partial + data).split(b"\n")
        for raw in complete:
            self._emit(raw)
        if len(self._partial) > _MAX_LINE_BYTES:
            self._emit(self._partial)
            self._partial = b""

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if self._partial:
            self._emit(self._partial)
            self._partial = b""
        if not self.output_closed.done():
            self.output_closed.set_result(None)

    def process_exited(self) -> None:
        assert self._transport is not None
        code = self._transport.get_returncode()
        if not self.exited.done():
            self.exited.set_result(-1 if code is None else code)

    def _emit(self, raw: bytes) -> None:
        self._on_line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))


class UpstreamProcess:
    """One model's server process. Not thread-safe; use from one event loop."""

    def __init__(
        self,
        spec: UpstreamSpec,
        *,
        health_check_timeout: float,
        logs: LogBuffer,
        client: httpx.AsyncClient | None = None,
        on_spawn: Callable[[UpstreamProcess], None] | None = None,
    ) -> None:
        self.spec = spec
        self.health_check_timeout = health_check_timeout
        self._logs = logs
        self._client = client
        # Called once pid and cmdline are known, before the health wait, so the
        # caller can record the process before a long model load.
        self._on_spawn = on_spawn
        self._source = f"upstream:{spec.id}"
        self.pid: int | None = None
        # As /proc shows it after exec (a script's interpreter included), for process_matches.
        self.cmdline: list[str] = list(spec.cmd)
        self.started_at: float | None = None  # unix seconds
        self.stopping = False  # stop() was called: an exit from now on is no crash
        self.killed = False  # the last stop needed SIGKILL
        self._protocol: _OutputProtocol | None = None
        self._reaper: asyncio.Task[int] | None = None
        self._stopped = False
        self._stop_lock = asyncio.Lock()
        self._tail: deque[str] = deque(maxlen=_OUTPUT_TAIL_LINES)

    @property
    def running(self) -> bool:
        return self._protocol is not None and not self._protocol.exited.done()

    @property
    def exit_code(self) -> int | None:
        if self._protocol is None or not self._protocol.exited.done():
            return None
        return self._protocol.exited.result()

    @property
    def last_output(self) -> list[str]:
        """The last lines the process (or its cmd_stop) wrote, oldest first."""
        return list(self._tail)

    async def start(self) -> int:
        """Spawn the process and wait until its health check answers 200; returns the pid."""
        if self.running:
            raise RuntimeError(f"upstream {self.spec.id} is already running (pid {self.pid})")
        if self._reaper is not None and not self._stopped:
            await self.stop()  # a crashed predecessor may have left children in its group
        cmd = list(self.spec.cmd)
        if not cmd:
            raise UpstreamStartError("cmd is empty", model_id=self.spec.id)
        self._tail.clear()
        self._stopped = self.stopping = self.killed = False
        try:
            transport, protocol = await self._spawn(cmd)
        except OSError as exc:
            reason = f"cannot run {cmd[0]!r}: {exc}"
            raise UpstreamStartError(reason, model_id=self.spec.id) from exc
        pid = transport.get_pid()
        self.pid = pid
        self.cmdline = _read_cmdline(pid) or cmd
        self.started_at = time.time()
        self._protocol = protocol
        self._reaper = asyncio.create_task(self._reap(pid, transport, protocol))
        try:
            if self._on_spawn is not None:
                self._on_spawn(self)
            await self._wait_healthy()
        except BaseException:
            # Timed out, exited, or cancelled: never leave a half-started server behind.
            await asyncio.shield(self.stop())
            raise
        return pid

    async def stop(self) -> int | None:
        """Stop the process group; returns the exit code (None if never started). Idempotent."""
        if self.pid is None or self._protocol is None or self._reaper is None:
            return None
        self.stopping = True
        async with self._stop_lock:
            if not self._stopped:
                await self._stop(self.pid, self._protocol, self._reaper)
                self._stopped = True
        return self.exit_code

    async def wait_exit(self) -> int:
        """Resolves with the exit code once the process has exited and its output is read."""
        if self._reaper is None:
            raise RuntimeError(f"upstream {self.spec.id} was never started")
        return await asyncio.shield(self._reaper)

    # -- internals -------------------------------------------------------------

    def _on_output(self, line: str) -> None:
        self._tail.append(line)
        self._logs.append(self._source, line)

    async def _spawn(
        self, argv: Sequence[str]
    ) -> tuple[asyncio.SubprocessTransport, _OutputProtocol]:
        loop = asyncio.get_running_loop()
        return await loop.subprocess_exec(
            lambda: _OutputProtocol(self._on_output),
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env},
            start_new_session=True,
        )

    async def _wait_healthy(self) -> None:
        endpoint = self.spec.check_endpoint
        if endpoint is None:
            return
        url = self.spec.proxy.rstrip("/") + "/" + endpoint.lstrip("/")
        if self._client is not None:
            await self._poll_health(self._client, url)
            return
        # Environment proxies must not intercept a check of a local port.
        async with httpx.AsyncClient(trust_env=False) as client:
            await self._poll_health(client, url)

    async def _poll_health(self, client: httpx.AsyncClient, url: str) -> None:
        assert self._protocol is not None and self._reaper is not None
        loop = asyncio.get_running_loop()
        exited = self._protocol.exited
        deadline = loop.time() + self.health_check_timeout
        last = "no answer yet"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                reason = (
                    f"not healthy at {url} within {self.health_check_timeout:g}s (last: {last})"
                )
                raise UpstreamStartError(reason, model_id=self.spec.id, output=self._tail)
            probe = asyncio.ensure_future(client.get(url, timeout=remaining))
            # Race the probe against exit so a crash fails the start at once.
            waiting: set[asyncio.Future[Any]] = {probe, exited}
            await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not probe.done():
                probe.cancel()
                await asyncio.wait({probe})
            if exited.done():
                code = await asyncio.shield(self._reaper)  # includes the last output lines
                reason = f"exited with code {code} during start"
                raise UpstreamStartError(
                    reason, model_id=self.spec.id, exit_code=code, output=self._tail
                )
            if not probe.cancelled():
                error = probe.exception()
                if error is None:
                    status = probe.result().status_code
                    if status == 200:
                        return
                    last = f"HTTP {status}"
                else:
                    last = f"{type(error).__name__}: {error}" if str(error) else repr(error)
            pause = min(_HEALTH_POLL_INTERVAL, max(0.0, deadline - loop.time()))
            await asyncio.wait({exited}, timeout=pause)

    async def _stop(self, pid: int, protocol: _OutputProtocol, reaper: asyncio.Task[int]) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.spec.unload_timeout
        deadline = loop.time() + timeout
        stopper: _OutputProtocol | None = None
        stopper_transport: asyncio.SubprocessTransport | None = None
        if not protocol.exited.done() or _group_alive(pid):
            if self.spec.cmd_stop and not protocol.exited.done():
                argv = [arg.replace(_PID_MACRO, str(pid)) for arg in self.spec.cmd_stop]
                try:
                    stopper_transport, stopper = await self._spawn(argv)
                except OSError as exc:
                    self._logs.append(
                        "proxy", f"{self.spec.id}: cmd_stop failed ({exc}); sending SIGTERM"
                    )
            if stopper is None:
                _signal_group(pid, signal.SIGTERM)
            await _wait_group_gone(pid, protocol.exited, deadline)
            if not protocol.exited.done() or _group_alive(pid):
                self.killed = True
                self._logs.append(
                    "proxy",
                    f"{self.spec.id}: pid {pid} still running {timeout:g}s after stop; SIGKILL",
                )
                _signal_group(pid, signal.SIGKILL)
                await _wait_group_gone(pid, protocol.exited, loop.time() + _KILL_WAIT)
        await asyncio.wait({reaper}, timeout=_KILL_WAIT)
        if stopper is not None and stopper_transport is not None:
            await _finish_helper(stopper_transport, stopper, max(0.0, deadline - loop.time()))

    async def _reap(
        self, pid: int, transport: asyncio.SubprocessTransport, protocol: _OutputProtocol
    ) -> int:
        code = await protocol.exited
        if not self.stopping and _group_alive(pid):
            # A crash orphans the server's helpers; nobody will stop them, and
            # they may hold GPU memory. (A stop in progress handles its own.)
            self._logs.append("proxy", f"{self.spec.id}: pid {pid} exited; killing its group")
            _signal_group(pid, signal.SIGKILL)
            deadline = asyncio.get_running_loop().time() + _KILL_WAIT
            await _wait_group_gone(pid, protocol.exited, deadline)
        await _close_when_drained(transport, protocol)
        return code


async def _close_when_drained(
    transport: asyncio.SubprocessTransport, protocol: _OutputProtocol
) -> None:
    # The last lines often explain a crash; give the pipe a moment to drain.
    await asyncio.wait({protocol.output_closed}, timeout=_OUTPUT_DRAIN_TIMEOUT)
    transport.close()


async def _finish_helper(
    transport: asyncio.SubprocessTransport, protocol: _OutputProtocol, timeout: float
) -> None:
    # A cmd_stop that outlives its purpose must not linger either.
    await asyncio.wait({protocol.exited}, timeout=timeout)
    if not protocol.exited.done():
        _signal_group(transport.get_pid(), signal.SIGKILL)
        await asyncio.wait({protocol.exited}, timeout=_KILL_WAIT)
    await _close_when_drained(transport, protocol)


async def _wait_group_gone(pgid: int, leader_exited: asyncio.Future[int], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    remaining = deadline - loop.time()
    if remaining > 0 and not leader_exited.done():
        await asyncio.wait({leader_exited}, timeout=remaining)
    # Other members of the group send no exit notice: poll for them.
    while leader_exited.done() and _group_alive(pgid) and loop.time() < deadline:
        await asyncio.sleep(_GROUP_POLL_INTERVAL)


def process_matches(pid: int, cmdline: Sequence[str]) -> bool:
    """Whether PID is alive and runs exactly CMDLINE (guards against a reused pid)."""
    current = _read_cmdline(pid)
    return current is not None and current == list(cmdline) and _pid_alive(pid)


def find_group_leaders(
    cmdlines: Sequence[Sequence[str]],
) -> list[tuple[int, tuple[str, ...]]]:
    """(pid, cmdline) of live process-group leaders running exactly one of CMDLINES.

    Recovery uses it for upstreams a crash left behind before their
    ProcessStarted event reached the disk: gpulane starts each upstream as the
    leader of its own group, with the configured argv."""
    wanted = {tuple(c) for c in cmdlines}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        cmdline = _read_cmdline(pid)
        if cmdline is None or tuple(cmdline) not in wanted:
            continue
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in (b"Z", b"X") and int(fields[2]) == pid:
            found.append((pid, tuple(cmdline)))
    return found


def kill_process_group(pid: int, timeout: float) -> None:
    """SIGTERM the group PID leads, then SIGKILL what is left after TIMEOUT seconds.

    For recovery, where the upstream is no child of ours and cannot be awaited.
    If PID runs but leads no group, only PID itself is signalled: gpulane starts
    every upstream as a group leader, so its group is not one of ours.
    """
    if pid <= 1 or pid == os.getpid():
        raise ValueError(f"refusing to kill pid {pid}")
    try:
        whole_group = os.getpgid(pid) == pid
    except ProcessLookupError:
        whole_group = True  # leader gone; any process still in group PID is a remnant of it

    def send(sig: signal.Signals) -> None:
        if whole_group:
            _signal_group(pid, sig)
        else:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def alive() -> bool:
        return _group_alive(pid) if whole_group else _pid_alive(pid)

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, _KILL_WAIT)):
        if not alive():
            return
        send(sig)
        deadline = time.monotonic() + wait
        while alive() and time.monotonic() < deadline:
            time.sleep(_GROUP_POLL_INTERVAL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # already gone


def _read_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:
        return None  # a zombie, or a kernel thread
    return [os.fsdecode(arg) for arg in raw.rstrip(b"\0").split(b"\0")]


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _pid_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)  # no /proc: fall back to existence
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return fields[0] not in (b"Z", b"X")


def _group_alive(pgid: int) -> bool:
    """Whether any process of group PGID still runs (zombies excluded)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also counts zombies, which hold no memory and may never be reaped
    # in a container whose init does not reap orphans.
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
