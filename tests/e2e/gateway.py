"""Start `gpulane serve` as a user does (a subprocess on a free port) for e2e tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import psycopg.rows
import sqlalchemy

from tests.processes import carrying, kill_and_wait

REPO = Path(__file__).resolve().parents[2]
GATEWAY_VAR = "GPULANE_TEST_GATEWAY"
"""Names one Gateway in the environment of its gpulane and so of every upstream
that gpulane starts, which lead sessions of their own: `stop` finds by it what
a SIGKILLed gpulane left."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(size: int = 10) -> int:
    """First of `size` free ports below the ephemeral range (32768+), where our own
    client sockets could take an upstream's port between check and use."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 30000 - size)
        try:
            for port in range(first, first + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError("no free block of ports in 20000-30000")


def fake_model(name: str, *extra: str, ttl: int | None = None) -> str:
    """A config entry running tools.fake_upstream as this model's server."""
    args = " ".join(extra)
    entry = f"""
      {name}:
        cmd: {sys.executable} -m tools.fake_upstream --port ${{PORT}} --name {name} {args}
        checkEndpoint: /health
    """
    if ttl is not None:
        entry += f"    ttl: {ttl}\n"
    return textwrap.dedent(entry)


@contextlib.contextmanager
def running_gateway(tmp: Path, config_text: str) -> Iterator[Gateway]:
    """A started Gateway, stopped however the block ends (module fixtures)."""
    gateway = Gateway(tmp, config_text).start()
    try:
        yield gateway
    finally:
        gateway.stop()


class Gateway:
    def __init__(self, tmp: Path, config_text: str) -> None:
        self.tmp = tmp
        self.config = tmp / "config.yaml"
        if "startPort" not in config_text:
            # Not the default 5800: a gpulane the user runs must not collide with tests.
            config_text = f"startPort: {free_port_block()}\n" + config_text
        self.config.write_text(config_text)
        self.db = tmp / "gpulane.db"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "gpulane.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.marker = uuid.uuid4().hex
        self.killed = False
        """SIGKILLed, and not started since: its upstreams may still run."""
        self.args: list[str] = []
        """More `gpulane serve` arguments (`--watch-config`)."""
        self.env: dict[str, str] = {}
        """More environment variables for `gpulane serve`."""

    def start(self, timeout: float = 60, *, up: Callable[[str], bool] | None = None) -> Gateway:
        """Start `gpulane serve` and wait until `/health` answers OK (or what `up`
        accepts of its text: a standby's, a server waiting for its disk)."""
        env = os.environ | self.env | {"PYTHONUNBUFFERED": "1", GATEWAY_VAR: self.marker}
        self.killed = False  # the next start's recovery stops what the last one left
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app.cli",
                "serve",
                "--config",
                str(self.config),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--db",
                str(self.db),
                *self.args,
            ],
            cwd=REPO,
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        # One client for all polls: making one costs ~30 ms of CPU, which a poll
        # every 50 ms would take from the gpulane it waits for.
        with httpx.Client(timeout=1) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"gpulane exited with {self.proc.returncode}:\n{self.log.read_text()}"
                    )
                try:
                    health = client.get(self.url + "/health").text
                    # A standby is up once it says so (tests/e2e/test_standby.py).
                    if (
                        health == "OK"
                        or ("--standby" in self.args and health.startswith("standby"))
                        or (up is not None and up(health))
                    ):
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"gpulane did not answer /health:\n{self.log.read_text()}")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 15 s. Once gpulane was SIGKILLed (here, or by
        `kill` with no start since), the upstreams it left are SIGKILLed too: a
        SIGKILL does not reach them, and no recovery will run to stop them."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.killed:
            kill_and_wait(carrying(GATEWAY_VAR, self.marker))
            self.killed = False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.killed = True

    def db_check(self) -> subprocess.CompletedProcess[str]:
        """`gpulane db check` on this gateway's database, as a user runs it."""
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "db", "check", "--db", str(self.db)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def sql(self, query: str, *params: Any) -> list[sqlite3.Row]:
        """Plain SQL against the gateway's database, as a user would run it (`?`
        placeholders; rows by column name on PostgreSQL too)."""
        if str(self.db).startswith("postgresql"):
            return postgres_sql(str(self.db), query, *params)  # type: ignore[return-value]
        conn = sqlite3.connect(self.db, timeout=10)
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(query, params).fetchall()
        finally:
            conn.close()

    def wait_for(
        self, query: str, *params: Any, count: int = 1, timeout: float = 30
    ) -> list[sqlite3.Row]:
        """Rows of `query` once it returns at least `count` (events are group-committed
        asynchronously, so a response can arrive just before its last event is on disk).
        `timeout` only guards against a hang: a loaded host may take seconds."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.sql(query, *params)
            if len(rows) >= count or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


def postgres_sql(url: str, query: str, *params: Any) -> list[dict[str, Any]]:
    """`Gateway.sql` on a PostgreSQL database named by its SQLAlchemy URL."""
    parts = sqlalchemy.make_url(url)
    with psycopg.connect(
        host=parts.query.get("host") or parts.host,
        port=parts.query.get("port") or parts.port,
        user=parts.username,
        dbname=parts.database,
        row_factory=psycopg.rows.dict_row,
        autocommit=True,
    ) as conn:
        return conn.execute(query.replace("?", "%s"), params).fetchall()  # type: ignore[arg-type]


def raw_request(
    gw: Gateway, head: bytes, body: bytes = b"", timeout: float = 30
) -> tuple[int, bytes]:
    """Send exact bytes (httpx refuses non-ASCII header values): `head` is the
    request line and header lines, each ending in CRLF; Content-Length and the
    blank line are added. Returns the status and the body."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=timeout) as sock:
        try:
            sock.sendall(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read everything: the answer may be waiting
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a whole response head: {data!r}")
            data += chunk
        head_end = data.index(b"\r\n\r\n")
        status = int(data.split(b" ", 2)[1])
        length = 0
        for line in data[:head_end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        rest = data[head_end + 4 :]
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest


def upstreams_alive(first_port: int, count: int) -> dict[int, str]:
    """Live tools.fake_upstream processes (zombies aside) serving a port in
    [first_port, first_port + count), pid -> command line: a test's own
    upstreams, found by the ports its config gives them."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X"):
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "tools.fake_upstream" not in args or "--port" not in args[:-1]:
            continue
        port = args[args.index("--port") + 1]
        if port.isdigit() and first_port <= int(port) < first_port + count:
            found[int(entry.name)] = " ".join(args)
    return found


def upstreams_left(first_port: int, count: int, timeout: float = 15) -> dict[int, str]:
    """What `upstreams_alive` still finds once `timeout` has passed or nothing
    is left; what it found is then SIGKILLed, so a failing test leaves nothing
    behind either."""
    deadline = time.monotonic() + timeout
    while (left := upstreams_alive(first_port, count)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a fake's `--record FILE` wrote (tools/fake_comfyui.py,
    tools/fake_video_server.py); none before its first."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(check: Callable[[], Any], timeout: float = 30, step: float = 0.05) -> Any:
    """The first truthy value of `check()`, or its last (falsy) one at `timeout`:
    the caller asserts (`poll` asserts itself)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def half_done(
    client: httpx.Client, request_id: str, timeout: float = 30
) -> tuple[dict[str, Any], list[list[int]]]:
    """`request_id`'s row in `/api/queue` once its progress is half done, and
    every progress seen until then."""
    seen: list[list[int]] = []

    def check() -> dict[str, Any] | None:
        running = client.get("/api/queue").json()["running"]
        found = next((x for x in running if x["request_id"] == request_id), None)
        if found is not None and found["progress"] is not None:
            seen.append(found["progress"])
            if found["progress"][0] * 2 >= found["progress"][1]:
                return found  # type: ignore[no-any-return]
        return None

    half = wait_for(check, timeout=timeout)
    assert half is not None, f"no progress past half in /api/queue: {seen}"
    return half, seen


def progress_events(gw: Gateway, request_id: str) -> list[dict[str, Any]]:
    """`request_id`'s `request_progressed` events, in order."""
    query = "SELECT data FROM events WHERE request_id=? AND type='request_progressed' ORDER BY seq"
    return [json.loads(r["data"]) for r in gw.sql(query, request_id)]


def poll(check: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    """The first truthy value of `check()`, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
