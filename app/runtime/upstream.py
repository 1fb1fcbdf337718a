"""The server process behind one model: start it, wait until healthy, stop it.

Each upstream runs in its own session (so its own process group) with an
environment marker naming this start. Stopping signals the whole group and
every other process the upstream started (found by parentage, group, or the
marker, which survives ``setsid`` and double forks), so no helper outlives it
holding GPU memory or the port.

A server started elsewhere (Ollama, a container, ...) may already answer on the
model's port: as in llama-swap, `cmd` then runs anyway (often a placeholder
such as `sleep infinity`) and the model is served through that server once
health answers; gpulane never signals it. What is refused is a port held by an
upstream of this gpulane's own (its environment carries this server's owner
marker): another model's server, or a leftover of a crashed run, which would
answer for the wrong model (see ``_look_at_port`` and ``_stale_listener``).

Exits are observed, not polled: the leader's through the subprocess protocol
(``Process.wait()`` on Python 3.11 also waits for the output pipe to close, so
it would hang while an escaped grandchild keeps it open), other processes'
through pidfds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httpx

from app.runtime.health_probe import HttpProbe, accepts_connections, local_port, probe_httpx
from app.runtime.log_buffer import LogBuffer
from app.runtime.out_of_memory import out_of_memory_line
from app.runtime.process_table import (
    Proc,
    all_pids,
    all_procs,
    descendants,
    describe,
    env_entry,
    family,
    read_cmdline,
    read_proc,
    signal_procs,
    socket_holders,
    stat_fields,
    tcp_listeners,
    wait_gone,
)

ENV_MARKER = "GPULANE_UPSTREAM"
"""Set to "OWNER:MODEL:START-ID" in each upstream's environment; its descendants
inherit it. OWNER names the gpulane database, so recovery finds what an upstream
of a crashed server left, and never another server's (`owner_marker`)."""


def owner_marker(owner: str) -> bytes:
    """The start of the marker of every upstream a server with this owner starts."""
    return os.fsencode(f"{ENV_MARKER}={owner}:")


# Health polls back off with the time waited so far: a server ready in 300 ms
# is seen within ~15 ms of it, one loading for minutes costs 10 probes a second.
_HEALTH_POLL_FIRST = 0.002
_HEALTH_POLL_FRACTION = 0.05
_HEALTH_POLL_MAX = 0.1
_GROUP_POLL_FIRST = 0.001  # group members are polled only where /proc cannot be read
_GROUP_POLL_MAX = 0.05
_OUTPUT_TAIL_LINES = 30
_OUT_OF_MEMORY_RECENT = 200
"""An out-of-memory line counts for an exit within this many lines of output
after it (vLLM's root cause comes some 60 lines of traceback before its exit);
one long before (ComfyUI goes on after a render ran out) says nothing of it."""
_OUTPUT_DRAIN_TIMEOUT = 0.5  # after exit, for the last lines still in the pipe
_KILL_WAIT = 5.0  # SIGKILL cannot be ignored, but teardown can take a moment
_MAX_LINE_BYTES = 64 * 1024  # a longer line without a newline is logged in pieces
_PID_MACRO = "${PID}"
_EXTERNAL_GRACE = 0.25
"""With a server started elsewhere on the port, health answers at once: the cmd
is given llama-swap's 250 ms before the first health check to fail (a server
that cannot bind the port exits), so it fails the start instead of crashing
just after it."""


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
        out_of_memory: str | None = None,
    ) -> None:
        self.reason = reason
        self.model_id = model_id
        self.exit_code = exit_code  # None when it did not exit by itself
        self.output = list(output)
        self.out_of_memory = out_of_memory
        """The server's line saying the GPU ran out of memory (app/runtime/out_of_memory.py),
        or None: the load failed for another reason, or nothing said so."""
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
        owner: str = "",
    ) -> None:
        self.spec = spec
        self._owner = owner
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
        self._lines = 0  # output lines of this start so far
        self._out_of_memory: tuple[int, str] | None = None  # (its line number, the line)
        self._port = local_port(spec.proxy)  # None: not on this machine, nothing to check
        self._root: Proc | None = None  # the leader as /proc saw it at spawn; None without /proc
        self._marker: bytes | None = None  # ENV_MARKER=VALUE of the current start
        self.external: str | None = None
        """Who answered on the port before the cmd ran (a server started elsewhere), or None."""

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

    @property
    def out_of_memory(self) -> str | None:
        """The first line of this start's output saying the GPU ran out of memory,
        while it is recent (`_OUT_OF_MEMORY_RECENT`), else None."""
        seen = self._out_of_memory
        if seen is None or self._lines - seen[0] > _OUT_OF_MEMORY_RECENT:
            return None
        return seen[1]

    async def start(self) -> int:
        """Spawn the process and wait until its health check answers 200; returns the pid.

        Refused before anything is spawned when an upstream of this gpulane
        already listens on the model's port (pid stays None then); a server
        started elsewhere is served through (`external`)."""
        if self.running:
            raise RuntimeError(f"upstream {self.spec.id} is already running (pid {self.pid})")
        if self._reaper is not None and not self._stopped:
            await self.stop()  # a crashed predecessor may have left children in its group
        cmd = list(self.spec.cmd)
        if not cmd:
            raise UpstreamStartError("cmd is empty", model_id=self.spec.id)
        self.pid = self._protocol = self._reaper = None  # a refused start leaves no trace
        self.external = self._look_at_port()
        self._tail.clear()
        self._lines, self._out_of_memory = 0, None
        self._stopped = self.stopping = self.killed = False
        marker = f"{ENV_MARKER}={self._owner}:{self.spec.id}:{uuid.uuid4().hex}"
        try:
            transport, protocol = await self._spawn(cmd, marker=marker)
        except OSError as exc:
            reason = f"cannot run {cmd[0]!r}: {exc}"
            raise UpstreamStartError(reason, model_id=self.spec.id) from exc
        pid = transport.get_pid()
        self.pid = pid
        self._root = read_proc(pid)
        self._marker = os.fsencode(marker)
        self.cmdline = read_cmdline(pid) or cmd
        self.started_at = time.time()
        self._protocol = protocol
        self._reaper = asyncio.create_task(self._reap(pid, transport, protocol))
        try:
            if self._on_spawn is not None:
                self._on_spawn(self)
            await self._wait_healthy()
        except BaseException:
            # Timed out, exited, refused or cancelled: never leave a half-started server behind.
            await asyncio.shield(self.stop())
            raise
        return pid

    async def stop(self) -> int | None:
        """Stop the process group and all else the upstream started; returns the exit
        code (None if never started). Idempotent."""
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
        self._lines += 1
        if self.out_of_memory is None and (found := out_of_memory_line(line)) is not None:
            self._out_of_memory = (self._lines, found)
        self._tail.append(line)
        self._logs.append(self._source, line)

    async def _spawn(
        self, argv: Sequence[str], *, marker: str | None = None
    ) -> tuple[asyncio.SubprocessTransport, _OutputProtocol]:
        loop = asyncio.get_running_loop()
        env = {**os.environ, **self.spec.env}
        if marker is not None:  # not for cmd_stop: a sweep would take it for a leftover
            name, _, value = marker.partition("=")
            env[name] = value
        return await loop.subprocess_exec(
            lambda: _OutputProtocol(self._on_output),
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    # -- the port --------------------------------------------------------------

    def _look_at_port(self) -> str | None:
        """Who already listens on the model's port, when it is a server started
        elsewhere (logged: the model is served through it); None when nobody
        does. UpstreamStartError when it is an upstream of this gpulane."""
        port = self._port
        if port is None:
            return None
        listeners = tcp_listeners(port)
        if listeners is None:  # no /proc/net: ask the port itself
            return self._note_external(port, "a server", "") if accepts_connections(port) else None
        held = [listener for listener in listeners if listener.reachable_locally]
        if not held:
            return None
        holders = socket_holders({listener.inode for listener in held}, all_pids())
        pids = sorted({pid for found in holders.values() for pid in found})
        where = ", ".join(listener.address for listener in held)
        for pid in pids:
            own = self._own_upstream(pid)
            if own is not None:
                reason = (
                    f"port {port} is already in use by {describe(pid)}, {own} (listening on "
                    f"{where}); stop it or give this model another port"
                )
                raise UpstreamStartError(reason, model_id=self.spec.id)
        who = ", ".join(describe(pid) for pid in pids) or "a process gpulane cannot see"
        return self._note_external(port, who, f" (listening on {where})")

    def _own_upstream(self, pid: int) -> str | None:
        """'an upstream gpulane started for MODEL' when PID carries this server's
        owner marker (and is not of the current start), else None."""
        entry = env_entry(pid, owner_marker(self._owner))
        if entry is None or entry == self._marker:
            return None
        model = entry.split(b"=", 1)[1].decode(errors="replace").split(":")
        named = ":".join(model[1:-1]) if len(model) >= 3 else "?"
        return f"an upstream gpulane started for model {named!r}"

    def _note_external(self, port: int, who: str, where: str) -> str:
        self._logs.append(
            "proxy",
            f"{self.spec.id}: port {port} is answered by {who}{where}, which gpulane did not "
            f"start: serving {self.spec.id} through it (a server started elsewhere); "
            "its cmd runs anyway and stopping the model stops only that",
        )
        return who

    async def _stale_listener(self) -> str | None:
        """Why the server that answered health must not serve this model, or None.

        Accepted: the upstream or what it started (the common case, checked
        cheaply first), and any process gpulane did not start: a container
        runtime's port proxy (`docker run -p`), a server started elsewhere, one
        gpulane cannot see (another user's). Refused: an upstream of this
        gpulane's own that took the port after `_look_at_port` (another
        model's server); it, not the model, would answer the requests."""
        port, root = self._port, self._root
        if port is None or root is None:
            return None
        listeners = [
            listener for listener in tcp_listeners(port) or () if listener.reachable_locally
        ]
        inodes = {listener.inode for listener in listeners}
        inodes -= set(socket_holders(inodes, [root.pid]))
        if not inodes:
            return None
        return await asyncio.to_thread(self._stale_holder, port, root, inodes)

    def _stale_holder(self, port: int, root: Proc, inodes: set[int]) -> str | None:
        procs = all_procs()
        ours = {proc.pid for proc in family(root, self._marker, procs)}
        for pids in socket_holders(inodes, procs).values():
            for pid in pids:
                own = None if pid in ours else self._own_upstream(pid)
                if own is not None:
                    return (
                        f"port {port} is answered by {describe(pid)}, {own} (this model's "
                        f"process is pid {root.pid}); stop it or give this model another port"
                    )
        return None

    # -- health ----------------------------------------------------------------

    async def _wait_healthy(self) -> None:
        endpoint = self.spec.check_endpoint
        if endpoint is None:
            return
        url = self.spec.proxy.rstrip("/") + "/" + endpoint.lstrip("/")
        parts = urlsplit(url)
        client = self._client
        if client is not None:
            await self._poll_health(url, lambda timeout: probe_httpx(client, url, timeout))
        elif parts.scheme == "http":
            await self._poll_health(url, HttpProbe(parts))
        else:
            # Environment proxies must not intercept a check of a local port.
            async with httpx.AsyncClient(trust_env=False) as own:
                await self._poll_health(url, lambda timeout: probe_httpx(own, url, timeout))

    async def _poll_health(self, url: str, probe_once: Callable[[float], Awaitable[int]]) -> None:
        assert self._protocol is not None and self._reaper is not None
        loop = asyncio.get_running_loop()
        exited = self._protocol.exited
        started = loop.time()
        deadline = started + self.health_check_timeout
        last = "no answer yet"
        if self.external is not None:
            await asyncio.wait({exited}, timeout=min(_EXTERNAL_GRACE, self.health_check_timeout))
            last = f"port already answered by {self.external}, which gpulane did not start"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                reason = (
                    f"not healthy at {url} within {self.health_check_timeout:g}s (last: {last})"
                )
                raise UpstreamStartError(
                    reason,
                    model_id=self.spec.id,
                    output=self._tail,
                    out_of_memory=self.out_of_memory,
                )
            probe = asyncio.ensure_future(probe_once(remaining))
            # Race the probe against exit so a crash fails the start at once.
            waiting: set[asyncio.Future[Any]] = {probe, exited}
            await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if not probe.done():
                probe.cancel()
                await asyncio.wait({probe})
            if exited.done():
                code = await asyncio.shield(self._reaper)  # includes the last output lines
                reason = f"exited with code {code} during start"
                if self.external is not None:
                    reason += (
                        f"; its port was already answered by {self.external}, which gpulane did "
                        "not start: for a server started elsewhere, give the model a cmd that "
                        "keeps running (a placeholder such as `sleep infinity`), or another port"
                    )
                raise UpstreamStartError(
                    reason,
                    model_id=self.spec.id,
                    exit_code=code,
                    output=self._tail,
                    out_of_memory=self.out_of_memory,
                )
            if not probe.cancelled():
                error = probe.exception()
                if error is None:
                    status = probe.result()
                    if status == 200:
                        stale = await self._stale_listener()
                        if stale is None:
                            return
                        raise UpstreamStartError(stale, model_id=self.spec.id, output=self._tail)
                    last = f"HTTP {status}"
                elif not (isinstance(error, TimeoutError) and deadline - loop.time() < 0.05):
                    last = f"{type(error).__name__}: {error}" if str(error) else repr(error)
                # else: a probe cut short by the deadline tells nothing new; the
                # last real answer (an HTTP 503, say) is what the caller needs.
            waited = loop.time() - started
            pause = max(_HEALTH_POLL_FIRST, min(_HEALTH_POLL_MAX, waited * _HEALTH_POLL_FRACTION))
            await asyncio.wait({exited}, timeout=min(pause, max(0.0, deadline - loop.time())))

    # -- stopping --------------------------------------------------------------

    async def _stop(self, pid: int, protocol: _OutputProtocol, reaper: asyncio.Task[int]) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.spec.unload_timeout
        deadline = loop.time() + timeout
        stopper: _OutputProtocol | None = None
        stopper_transport: asyncio.SubprocessTransport | None = None
        # Look before signalling: once a parent exits, its children that cleared
        # their environment are linked to us by nothing else. (Those that carry
        # the marker are found after the leader exits, by _sweep.)
        left = await self._descendants()
        if not protocol.exited.done() or left or _group_alive(pid):
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
            if not await self._sweep(pid, protocol.exited, signal.SIGTERM, left, deadline):
                self.killed = True
                self._logs.append(
                    "proxy",
                    f"{self.spec.id}: pid {pid} or what it started still running "
                    f"{timeout:g}s after stop; SIGKILL",
                )
                _signal_group(pid, signal.SIGKILL)
                await self._sweep(
                    pid, protocol.exited, signal.SIGKILL, left, loop.time() + _KILL_WAIT
                )
        await asyncio.wait({reaper}, timeout=_KILL_WAIT)
        if stopper is not None and stopper_transport is not None:
            await _finish_helper(stopper_transport, stopper, max(0.0, deadline - loop.time()))

    async def _sweep(
        self,
        pgid: int,
        leader_exited: asyncio.Future[int],
        sig: signal.Signals,
        known: Sequence[Proc],
        deadline: float,
    ) -> bool:
        """Once the leader has exited, sends SIG to what it left outside its group
        (the group had its signal) and waits that out, looking again until
        nothing is left. True when nothing is left by DEADLINE.

        The leader goes first so that it can stop its own helpers in order (a
        container's monitor, say); only what it leaves is ours to signal."""
        loop = asyncio.get_running_loop()
        if not leader_exited.done():
            await asyncio.wait({leader_exited}, timeout=max(0.0, deadline - loop.time()))
            if not leader_exited.done():
                return False
        signalled: set[Proc] = set()
        while True:
            pending = list({*known, *await self._leftovers()})
            if not pending:
                return await self._group_gone(pgid, deadline)
            outside = [p for p in pending if p.pgrp != pgid and p not in signalled]
            signal_procs(outside, sig)
            signalled.update(outside)
            remaining = deadline - loop.time()
            if remaining <= 0 or await wait_gone(pending, remaining):
                return False
            known = []  # all gone: look again for any born meanwhile

    async def _leftovers(self) -> list[Proc]:
        """Live processes this start of the upstream started, its leader excluded."""
        root, marker = self._root, self._marker
        if root is None:
            return []

        def look() -> list[Proc]:
            return family(root, marker, all_procs())

        try:
            return await asyncio.to_thread(look)  # a scan of every process: off the loop
        except RuntimeError:  # the default executor is shut down: the loop is closing
            return look()

    async def _descendants(self) -> list[Proc]:
        root = self._root
        if root is None:
            return []
        found = descendants(root)  # a few small reads: cheaper than a thread hop
        return await self._leftovers() if found is None else found

    async def _group_gone(self, pgid: int, deadline: float) -> bool:
        if self._root is not None:
            return True  # the look that found nothing saw the group too
        # No /proc: only the group can be watched, by polling.
        loop = asyncio.get_running_loop()
        pause = _GROUP_POLL_FIRST
        while _group_alive(pgid):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, _GROUP_POLL_MAX)
        return True

    async def _reap(
        self, pid: int, transport: asyncio.SubprocessTransport, protocol: _OutputProtocol
    ) -> int:
        code = await protocol.exited
        if not self.stopping:
            # A crash orphans the server's helpers; nobody will stop them, and
            # they may hold GPU memory or the port. (A stop handles its own.)
            left = await self._leftovers()
            if left or _group_alive(pid):
                self._logs.append(
                    "proxy", f"{self.spec.id}: pid {pid} exited; killing what it started"
                )
                _signal_group(pid, signal.SIGKILL)
                deadline = asyncio.get_running_loop().time() + _KILL_WAIT
                await self._sweep(pid, protocol.exited, signal.SIGKILL, left, deadline)
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


def process_matches(pid: int, cmdline: Sequence[str]) -> bool:
    """Whether PID is alive and runs exactly CMDLINE (guards against a reused pid)."""
    current = read_cmdline(pid)
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
    for pid in all_pids():
        if pid == os.getpid():
            continue
        cmdline = read_cmdline(pid)
        if cmdline is None or tuple(cmdline) not in wanted:
            continue
        fields = stat_fields(pid)
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
        pause = _GROUP_POLL_FIRST
        while alive() and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, _GROUP_POLL_MAX)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # already gone


def _pid_alive(pid: int) -> bool:
    fields = stat_fields(pid)
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
        fields = stat_fields(entry)
        if fields and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
