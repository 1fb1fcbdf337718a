"""UpstreamProcess against real processes: tools.fake_upstream and tiny python -c children."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest

from app.runtime.log_buffer import LogBuffer
from app.runtime.process_table import read_proc
from app.runtime.upstream import (
    UpstreamProcess,
    UpstreamStartError,
    kill_process_group,
    process_matches,
)


@dataclass(frozen=True)
class Spec:
    id: str
    cmd: tuple[str, ...]
    proxy: str = "http://127.0.0.1:9"
    cmd_stop: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    check_endpoint: str | None = "/health"
    unload_timeout: float = 3.0


# Ignores SIGTERM and says so once that is in effect. With "spawn SRC" it first
# starts SRC as a child (which ignores SIGTERM) and then itself obeys SIGTERM.
IGNORE_TERM = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
role = "ignoring"
if sys.argv[1:2] == ["spawn"]:
    role = "parent"
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
    print("child", child.pid, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
print("ready", role, flush=True)
time.sleep(60)
"""
SPAWN_ARGS = ("spawn", IGNORE_TERM)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


async def wait_for_line(logs: LogBuffer, needle: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in logs.lines():
            if needle in line.text:
                return line.text
        await asyncio.sleep(0.02)
    raise AssertionError(f"{needle!r} not logged; got:\n{logs.text()}")


@pytest.fixture
def logs() -> LogBuffer:
    return LogBuffer()


@pytest.fixture
async def upstreams(logs: LogBuffer) -> AsyncIterator[Callable[..., UpstreamProcess]]:
    """Makes UpstreamProcess objects and stops every one of them at teardown."""
    made: list[UpstreamProcess] = []

    # 30 s: a guard against a hang; a loaded host may take seconds to start Python.
    def make(spec: Spec, health_check_timeout: float = 30, **kwargs: Any) -> UpstreamProcess:
        upstream = UpstreamProcess(
            spec, health_check_timeout=health_check_timeout, logs=logs, **kwargs
        )
        made.append(upstream)
        return upstream

    yield make
    for upstream in made:
        await upstream.stop()


@pytest.fixture
def fake_spec(
    free_tcp_port: Callable[[], int], fake_upstream_argv: Callable[..., list[str]]
) -> Callable[..., Spec]:
    def make(name: str = "alpha", *flags: str, **overrides: object) -> Spec:
        port = free_tcp_port()
        argv = fake_upstream_argv(port, "--name", name, *flags)
        return Spec(id=name, cmd=tuple(argv), proxy=f"http://127.0.0.1:{port}", **overrides)  # type: ignore[arg-type]

    return make


async def test_start_health_stop_and_log_capture(fake_spec, upstreams, logs):
    spec = fake_spec("alpha", "--start-delay", "0.3")
    spawned: list[tuple[int | None, bool]] = []
    upstream = upstreams(spec, on_spawn=lambda p: spawned.append((p.pid, p.running)))
    t0 = time.monotonic()
    pid = await upstream.start()
    assert time.monotonic() - t0 >= 0.3  # waited out the 503s while "loading"
    assert spawned == [(pid, True)]
    assert upstream.running and upstream.pid == pid and upstream.started_at is not None
    assert upstream.cmdline == list(spec.cmd)

    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m1", "messages": []})
    assert r.status_code == 200
    body = r.json()
    assert body["served_by"] == "alpha" and body["model"] == "m1"
    assert r.headers["X-Served-By"] == "alpha"
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Hello from alpha."
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    assert {"prompt_n", "predicted_n", "predicted_per_second"} <= body["timings"].keys()

    assert f"pid={pid}" in await wait_for_line(logs, "alpha starting")
    await wait_for_line(logs, "alpha handled POST /v1/chat/completions")
    assert {line.source for line in logs.lines()} == {"upstream:alpha"}

    assert await upstream.stop() == 0  # the fake exits 0 on SIGTERM
    assert not upstream.running and not alive(pid) and not upstream.killed
    assert await upstream.stop() == 0  # idempotent
    await wait_for_line(logs, "alpha received SIGTERM")


async def test_exit_at_start_fails_fast_with_output(fake_spec, upstreams):
    upstream = upstreams(fake_spec("quitter", "--exit-at-start"), health_check_timeout=10)
    t0 = time.monotonic()
    with pytest.raises(UpstreamStartError) as err:
        await upstream.start()
    assert time.monotonic() - t0 < 8  # not the 10 s health check: fails once it exits
    assert err.value.exit_code == 3
    assert "exited with code 3" in str(err.value)
    assert "quitter error: exiting at start as asked" in str(err.value)  # stderr too
    assert not upstream.running


# Prints vLLM's out-of-memory line (vllm/v1/core/kv_cache_utils.py), then
# argv[1] other lines, then exits 1.
OUT_OF_MEMORY_THEN = """
import sys
print("ValueError: No available memory for the cache blocks. Try increasing "
      "`gpu_memory_utilization` when initializing the engine.", file=sys.stderr, flush=True)
for i in range(int(sys.argv[1])):
    print("traceback line", i, flush=True)
sys.exit(1)
"""
VLLM_LINE = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)


async def test_an_out_of_memory_line_fails_the_start_so(upstreams):
    spec = Spec(id="vllm", cmd=(sys.executable, "-c", OUT_OF_MEMORY_THEN, "60"))
    upstream = upstreams(spec)
    with pytest.raises(UpstreamStartError) as err:
        await upstream.start()
    assert err.value.exit_code == 1 and err.value.out_of_memory == VLLM_LINE
    assert VLLM_LINE not in str(err.value)  # 60 lines back: out of the last output's 30
    assert upstream.out_of_memory == VLLM_LINE


@pytest.mark.parametrize(("lines_after", "said"), [(150, VLLM_LINE), (250, None)])
async def test_an_out_of_memory_line_counts_for_an_exit_while_recent(
    upstreams, lines_after: int, said: str | None
):
    spec = Spec(id="vllm", cmd=(sys.executable, "-c", OUT_OF_MEMORY_THEN, str(lines_after)))
    upstream = upstreams(replace(spec, check_endpoint=None))
    await upstream.start()
    assert await asyncio.wait_for(upstream.wait_exit(), 5) == 1
    assert upstream.out_of_memory == said


async def test_missing_executable_is_a_start_error(upstreams):
    upstream = upstreams(Spec(id="ghost", cmd=("/nonexistent/llama-server",)))
    with pytest.raises(UpstreamStartError, match="cannot run"):
        await upstream.start()


async def test_start_times_out_and_stops_the_process(fake_spec, upstreams):
    upstream = upstreams(fake_spec("sick", "--health-status", "503"), health_check_timeout=0.6)
    t0 = time.monotonic()
    with pytest.raises(UpstreamStartError) as err:
        await upstream.start()
    assert 0.6 <= time.monotonic() - t0 < 10  # (the upper bound: no hang)
    assert "HTTP 503" in str(err.value) and err.value.exit_code is None
    assert upstream.pid is not None and not alive(upstream.pid)


async def test_sigterm_ignored_falls_back_to_sigkill(upstreams, logs):
    spec = Spec(
        id="stubborn",
        cmd=(sys.executable, "-c", IGNORE_TERM),
        check_endpoint=None,
        unload_timeout=0.4,
    )
    upstream = upstreams(spec)
    pid = await upstream.start()
    await wait_for_line(logs, "ready ignoring")
    t0 = time.monotonic()
    assert await upstream.stop() == -9
    assert 0.4 <= time.monotonic() - t0 < 10  # (the upper bound: no hang)
    assert upstream.killed and not alive(pid)


async def test_children_in_the_group_are_killed(upstreams, logs):
    # The leader exits on SIGTERM; its child ignores SIGTERM and needs the SIGKILL sweep.
    spec = Spec(
        id="parent",
        cmd=(sys.executable, "-c", IGNORE_TERM, *SPAWN_ARGS),
        check_endpoint=None,
        unload_timeout=0.4,
    )
    upstream = upstreams(spec)
    await upstream.start()
    child = int((await wait_for_line(logs, "child ")).split()[1])
    await wait_for_line(logs, "ready parent")
    await wait_for_line(logs, "ready ignoring")
    assert alive(child)
    assert await upstream.stop() == -15
    assert upstream.killed and not alive(child)


async def test_a_crash_kills_the_rest_of_the_group(upstreams, logs):
    spec = Spec(id="crasher", cmd=(sys.executable, "-c", IGNORE_TERM, *SPAWN_ARGS))
    upstream = upstreams(replace(spec, check_endpoint=None))
    pid = await upstream.start()
    child = int((await wait_for_line(logs, "child ")).split()[1])
    os.kill(pid, signal.SIGKILL)  # nobody calls stop()
    assert await asyncio.wait_for(upstream.wait_exit(), 30) == -9
    assert not upstream.stopping and not alive(child)


async def test_cmd_stop_is_used_with_pid_macro(fake_spec, upstreams, logs):
    script = (
        "import os, signal, sys; print('cmd_stop for', sys.argv[1], flush=True); "
        "os.kill(int(sys.argv[1]), signal.SIGUSR1)"
    )
    spec = fake_spec("gentle", cmd_stop=(sys.executable, "-c", script, "${PID}"))
    upstream = upstreams(spec)
    pid = await upstream.start()
    assert await upstream.stop() == -10  # SIGUSR1, not the SIGTERM the default path sends
    await wait_for_line(logs, f"cmd_stop for {pid}")
    assert not upstream.killed


async def test_stream_chunks_arrive_incrementally(fake_spec, upstreams):
    spec = fake_spec("streamer")
    await upstreams(spec).start()
    fake = {"chunks": 4, "chunk_delay": 0.25, "reply": "one two three four"}
    request = {"model": "m", "stream": True, "messages": [], "fake": fake}
    arrivals: list[tuple[float, str]] = []
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        t0 = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=request) as r:
            assert r.headers["content-type"] == "text/event-stream"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - t0, line[6:]))
    assert arrivals[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in arrivals[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "one two three four"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["served_by"] == "streamer" and c["model"] == "m" for c in chunks)
    # The last chunk leaves >= 0.75 s after the first; the first must not wait for it.
    assert arrivals[0][0] < arrivals[-1][0] - 0.5


async def test_die_mid_stream_closes_the_stream_early(fake_spec, upstreams):
    spec = fake_spec("fragile")
    upstream = upstreams(spec)
    await upstream.start()
    request = {"model": "m", "stream": True, "fake": {"chunks": 6, "die_mid_stream": True}}
    received: list[str] = []
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", "/v1/chat/completions", json=request) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        received.append(line)
    assert len(received) == 3 and "data: [DONE]" not in received
    assert await asyncio.wait_for(upstream.wait_exit(), 30) == 1
    assert not upstream.running


async def test_other_endpoints_and_fake_options(fake_spec, upstreams):
    spec = fake_spec("multi")
    await upstreams(spec).start()
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        r = await client.post("/v1/completions", json={"model": "c", "prompt": "hi there"})
        assert r.json()["choices"][0]["text"] == "Hello from multi."
        assert r.json()["object"] == "text_completion"
        r = await client.post("/v1/embeddings", json={"model": "e", "input": ["a", "b"]})
        assert [d["index"] for d in r.json()["data"]] == [0, 1]
        assert len(r.json()["data"][0]["embedding"]) == 8
        r = await client.put("/anything?x=1", content=b"raw", headers={"X-Custom": "v"})
        echo = r.json()
        assert (echo["method"], echo["path"], echo["body"]) == ("PUT", "/anything?x=1", "raw")
        assert echo["headers"]["X-Custom"] == "v" and echo["served_by"] == "multi"
        r = await client.post("/v1/chat/completions", json={"fake": {"status": 429}})
        assert r.status_code == 429 and r.json()["error"]["code"] == 429
        r = await client.get("/health", headers={"X-Fake": '{"status": 500}'})
        assert r.status_code == 500
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json={"fake": {"hang": True}}, timeout=0.3)
        t0 = time.monotonic()
        r = await client.post("/v1/chat/completions", json={"fake": {"delay": 0.2}})
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.2


async def test_process_matches(fake_spec, upstreams):
    upstream = upstreams(fake_spec("matcher"))
    pid = await upstream.start()
    assert process_matches(pid, upstream.cmdline)
    assert not process_matches(pid, [*upstream.cmdline, "--extra"])
    assert not process_matches(pid, ["llama-server"])
    await upstream.stop()
    assert not process_matches(pid, upstream.cmdline)


def test_kill_process_group_at_recovery():
    # As after a crash of gpulane: a group leader that ignores SIGTERM, with a child.
    proc = subprocess.Popen(
        [sys.executable, "-c", IGNORE_TERM, *SPAWN_ARGS],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline().split()[1])
        assert sorted(proc.stdout.readline().split()[1] for _ in "ab") == ["ignoring", "parent"]
        t0 = time.monotonic()
        kill_process_group(proc.pid, timeout=0.3)
        assert time.monotonic() - t0 < 10  # (no hang)
        assert not alive(proc.pid) and not alive(child)  # zombies count as dead
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ValueError):
        kill_process_group(os.getpid(), timeout=0.1)


async def test_log_subscription_sees_upstream_lines_live(fake_spec, upstreams, logs):
    spec = fake_spec("talker")
    async with logs.subscribe(maxsize=100) as live:
        pid = await upstreams(spec).start()
        first = await asyncio.wait_for(live.get(), 30)
        assert first is not None and first.source == "upstream:talker"
        assert first.text == f"talker starting pid={pid} port={spec.proxy.rsplit(':', 1)[1]}"
    rest = [line.text async for line in live]  # closed: what was queued, then the end
    assert all("talker" in text for text in rest)
    assert "[upstream:talker] talker listening on" in logs.text()


async def test_slow_log_subscriber_drops_oldest_lines():
    buffer = LogBuffer(max_lines=3)
    sub = buffer.subscribe(maxsize=2)
    for i in range(5):
        buffer.append("proxy", f"line {i}\n")
    assert [line.text for line in buffer.lines()] == ["line 2", "line 3", "line 4"]
    sub.close()
    assert [line.text async for line in sub] == ["line 4"]  # room was made for the close
    assert sub.dropped == 4


# -- the upstream is who it should be (issue 10) --------------------------------

# Starts the fake upstream only after a line on stdin: a server older than the
# upstream that takes the port after gpulane checked it was free.
BIND_ON_INPUT = "import sys; from tools.fake_upstream import main; sys.stdin.readline(); main()"
NEVER_LISTENS = "import time; time.sleep(60)"
# A child in a session of its own with an empty environment: only its parent links it to us.
CLEAN_ENV_ESCAPEE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True, env={})
print("child", child.pid, flush=True)
time.sleep(60)
"""

# The same, ignoring SIGTERM itself, its child running the script in argv[1].
STUBBORN_ESCAPEE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, env={})
print("child", child.pid, flush=True)
time.sleep(60)
"""


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def foreign() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts processes gpulane did not start; kills them at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*argv: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.DEVNULL)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


async def test_a_server_started_elsewhere_is_served_through_a_placeholder_cmd(
    free_tcp_port, upstreams, foreign, fake_upstream_argv, logs
):
    # llama-swap's external server: Ollama or a container already answers on
    # the port; the model's cmd is a placeholder that only has to keep running.
    port = free_tcp_port()
    external = foreign(*fake_upstream_argv(port, "--name", "ollama"))
    await wait_until(lambda: accepts(port), "the external server to listen")
    spec = Spec(
        id="ext", cmd=(sys.executable, "-c", NEVER_LISTENS), proxy=f"http://127.0.0.1:{port}"
    )
    upstream = upstreams(spec)
    pid = await upstream.start()
    assert upstream.external is not None and f"pid {external.pid}" in upstream.external
    line = await wait_for_line(logs, "which gpulane did not start")
    assert f"port {port}" in line and "--name ollama" in line
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        assert (await client.get("/health")).headers["X-Served-By"] == "ollama"
    await upstream.stop()
    assert not alive(pid)  # the placeholder is stopped...
    assert external.poll() is None and accepts(port)  # ...the server started elsewhere is not


async def test_a_cmd_that_exits_beside_a_server_started_elsewhere_fails_the_start(
    fake_spec, upstreams, foreign, fake_upstream_argv
):
    # The cmd is a server of its own that cannot bind the taken port: as in
    # llama-swap, an exit before the first health check fails the start.
    spec = fake_spec("alpha")
    port = int(spec.proxy.rsplit(":", 1)[1])
    holder = foreign(*fake_upstream_argv(port, "--name", "squatter"))
    await wait_until(lambda: accepts(port), "the squatter to listen")
    upstream = upstreams(spec)
    with pytest.raises(UpstreamStartError) as err:
        await upstream.start()
    message = str(err.value)
    assert "during start" in message and f"pid {holder.pid}" in message
    assert "sleep infinity" in message
    assert holder.poll() is None  # the holder was left alone


@pytest.mark.parametrize("check_endpoint", ["/health", None])
async def test_a_port_held_by_an_upstream_of_this_gpulane_is_refused(
    check_endpoint, fake_spec, upstreams, foreign, fake_upstream_argv
):
    # A leftover of a crashed run of ours (or another model's server) carries
    # the owner marker in its environment: it would answer for the wrong model.
    spec = replace(fake_spec("alpha"), check_endpoint=check_endpoint)
    port = int(spec.proxy.rsplit(":", 1)[1])
    env = {**os.environ, "GPULANE_UPSTREAM": "db-1:beta:0123"}
    holder = subprocess.Popen(
        fake_upstream_argv(port, "--name", "stale"), env=env, stdout=subprocess.DEVNULL
    )
    try:
        await wait_until(lambda: accepts(port), "the stale upstream to listen")
        spawned: list[int | None] = []
        upstream = upstreams(spec, on_spawn=lambda p: spawned.append(p.pid), owner="db-1")
        with pytest.raises(UpstreamStartError) as err:
            await upstream.start()
        message = str(err.value)
        assert f"port {port} is already in use by pid {holder.pid}" in message
        assert "an upstream gpulane started for model 'beta'" in message
        assert spawned == [] and upstream.pid is None  # nothing was started
        # Another gpulane's (another owner's) upstream is a server started elsewhere.
        other = upstreams(replace(spec, cmd=(sys.executable, "-c", NEVER_LISTENS)), owner="db-2")
        await other.start()
        assert other.external is not None
    finally:
        holder.kill()
        holder.wait()


async def test_health_answered_by_another_of_our_upstreams_is_refused(
    free_tcp_port, upstreams, foreign
):
    # One of our own upstreams that binds the port after the look before spawning.
    port = free_tcp_port()
    env = {**os.environ, "GPULANE_UPSTREAM": "db-1:beta:0123"}
    squatter = subprocess.Popen(
        [sys.executable, "-c", BIND_ON_INPUT, "--port", str(port), "--name", "squatter"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
    )

    def let_the_squatter_bind(_: UpstreamProcess) -> None:
        assert squatter.stdin is not None
        squatter.stdin.write(b"go\n")
        squatter.stdin.flush()

    spec = Spec(
        id="mute", cmd=(sys.executable, "-c", NEVER_LISTENS), proxy=f"http://127.0.0.1:{port}"
    )
    upstream = upstreams(spec, on_spawn=let_the_squatter_bind, owner="db-1")
    try:
        with pytest.raises(UpstreamStartError) as err:
            await upstream.start()
        message = str(err.value)
        assert f"pid {squatter.pid}" in message and "--name squatter" in message
        assert "an upstream gpulane started for model 'beta'" in message
        assert upstream.pid is not None and not alive(upstream.pid)
    finally:
        squatter.kill()
        squatter.wait()


async def test_a_setsid_descendant_is_stopped_and_the_port_is_free_again(
    free_tcp_port, fake_upstream_argv, upstreams, logs
):
    port = free_tcp_port()
    argv = fake_upstream_argv(port, "--name", "daemon")
    spec = Spec(id="daemon", cmd=(*argv, "--spawn-setsid-child"), proxy=f"http://127.0.0.1:{port}")
    first = upstreams(spec)
    pid = await first.start()
    copy = int((await wait_for_line(logs, "daemon/setsid-child pid=")).split("pid=")[1].split()[0])
    assert alive(copy) and os.getsid(copy) != os.getsid(pid)
    assert await first.stop() == 0
    assert not alive(copy) and not first.killed
    assert not accepts(port)

    second = upstreams(replace(spec, cmd=tuple(argv)))
    await second.start()
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        for _ in range(5):
            r = await client.get("/health")
            assert r.headers["X-Served-By"] == "daemon"


async def test_a_descendant_with_no_marker_is_stopped_through_its_parent(upstreams, logs):
    spec = Spec(id="parent", cmd=(sys.executable, "-c", CLEAN_ENV_ESCAPEE), check_endpoint=None)
    upstream = upstreams(spec)
    pid = await upstream.start()
    child = int((await wait_for_line(logs, "child ")).split()[1])
    assert os.getsid(child) != os.getsid(pid)
    assert await upstream.stop() == -15
    assert not alive(child)


async def test_stubborn_leader_and_escapee_are_killed(upstreams, logs):
    # Both ignore SIGTERM; once SIGKILL takes the parent, only the look before
    # signalling links the child (own session, empty environment) to us.
    spec = Spec(
        id="stubborn",
        cmd=(sys.executable, "-c", STUBBORN_ESCAPEE, IGNORE_TERM),
        check_endpoint=None,
        unload_timeout=0.4,
    )
    upstream = upstreams(spec)
    await upstream.start()
    child = int((await wait_for_line(logs, "child ")).split()[1])
    await wait_for_line(logs, "ready ignoring")
    assert await upstream.stop() == -9
    assert upstream.killed and not alive(child)


async def test_a_crash_kills_setsid_descendants_too(fake_spec, upstreams, logs):
    upstream = upstreams(fake_spec("daemon", "--spawn-setsid-child"))
    pid = await upstream.start()
    copy = int((await wait_for_line(logs, "daemon/setsid-child pid=")).split("pid=")[1].split()[0])
    os.kill(pid, signal.SIGKILL)  # nobody calls stop()
    assert await asyncio.wait_for(upstream.wait_exit(), 5) == -9
    assert not alive(copy)


async def test_a_port_proxy_started_after_the_upstream_is_accepted(
    free_tcp_port, fake_upstream_argv, upstreams, foreign
):
    # As `docker run -p` has dockerd start a docker-proxy: the listener is no
    # descendant of the upstream, but it came into being after it.
    port = free_tcp_port()

    def start_port_proxy(upstream: UpstreamProcess) -> None:
        assert upstream.pid is not None
        spawned = read_proc(upstream.pid)
        assert spawned is not None
        deadline = time.monotonic() + 10
        while True:  # /proc counts start time in 10 ms ticks: "after" must be a later tick
            assert time.monotonic() < deadline, "no process started a tick after the upstream"
            proxy = foreign(*fake_upstream_argv(port, "--name", "port-proxy"))
            started = read_proc(proxy.pid)
            if started is not None and started.start_ticks > spawned.start_ticks:
                return
            proxy.kill()
            proxy.wait()

    spec = Spec(
        id="container",
        cmd=(sys.executable, "-c", NEVER_LISTENS),
        proxy=f"http://127.0.0.1:{port}",
    )
    await upstreams(spec, on_spawn=start_port_proxy).start()
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        assert (await client.get("/health")).headers["X-Served-By"] == "port-proxy"


async def test_health_is_checked_through_localhost(fake_spec, upstreams):
    # The default proxy is http://localhost:${PORT}; the fake listens on 127.0.0.1 only.
    spec = fake_spec("local", "--start-delay", "0.2")
    spec = replace(spec, proxy=spec.proxy.replace("127.0.0.1", "localhost"))
    upstream = upstreams(spec)
    await upstream.start()
    async with httpx.AsyncClient(base_url=spec.proxy) as client:
        assert (await client.get("/health")).status_code == 200
