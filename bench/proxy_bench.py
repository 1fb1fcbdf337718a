"""What gpulane's proxy path costs. Prints figures; asserts nothing.

    .venv/bin/python -m bench.proxy_bench [--rounds 2000] [--warmup 300] [--queued 1000]
                                          [--synchronous full|normal] [--no-nginx] [--keep DIR]

Starts `gpulane serve` (a subprocess) with one model whose server is
tools.fake_upstream (answers at once), and, where `nginx` is installed, an
nginx in front of the same upstream as the floor a C proxy sets.

1. Added latency. The same chat completion, non-streaming and streaming
   (`"stream": true`, 4 SSE chunks; time to last byte), sent one at a time
   over keep-alive connections to the upstream directly, through gpulane and
   through nginx, interleaved in random order in each round so drift hits every
   target alike. Added = percentile through the proxy - the same percentile
   direct. The client is a minimal HTTP/1.1 client on raw sockets (no httpx:
   its ~100 us per request would be noise of the size being measured). Also
   printed: gpulane's CPU time per request (user + system, all its threads,
   from /proc), the figure that decides the tail on a busy machine.

2. Dispatch gap. A first request holds the GPU (the fake hangs) while
   `--queued` clients (asyncio, raw sockets, one connection each) queue for the
   same model; then the first client leaves and the queue drains one request at
   a time (serial scheduler). The gap is measured from gpulane's own events:
   `request_completed.at` (last byte forwarded to the client; for the first,
   `request_cancelled.at`) -> the next `request_started.at` (about to send
   upstream), in exact nanoseconds from the events' `data`. Not measured: the
   gap as the upstream sees it (the fake keeps no timestamps). Also printed:
   the drain rate.

3. Throughput. `--clients` clients (asyncio, raw sockets, one keep-alive
   connection each) send small non-streaming requests back to back for
   `--seconds` to a second model, `wide`, with as many slots
   (`concurrencyLimit`) as clients, in a group that keeps both models loaded.
   Printed: requests per second and gpulane's CPU per request in that phase.

Targets (issue 4): added p50 < 1.5 ms, p99 < 5 ms; dispatch gap p99 < 5 ms.
Profile: `py-spy record -p PID` with the pid printed at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy

from app.store.engine import database_url

REPO = Path(__file__).resolve().parents[1]
MODEL = "fast"
WIDE = "wide"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STREAM_CHUNKS = 4
# tools.fake_upstream writes the head and the body of a reply separately; without
# TCP_NODELAY the body waits for the client's delayed ACK (~40 ms on Linux). A
# listen backlog of 5 (socketserver's) resets some of 32 connections opened at once.
FAKE_NODELAY = (
    "import sys; import tools.fake_upstream as f; "
    "f.FakeHandler.disable_nagle_algorithm = True; f.FakeServer.request_queue_size = 128; "
    "f.main(sys.argv[1:])"
)
TARGETS = {"added_p50_ms": 1.5, "added_p99_ms": 5.0, "gap_p99_ms": 5.0}


# -- a minimal HTTP/1.1 client --------------------------------------------------------


def request_bytes(port: int, path: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


class Response:
    """Incremental HTTP/1.1 response parser: feed bytes, `done` when the body is complete."""

    def __init__(self) -> None:
        self.buf = b""
        self.status = 0
        self.length: int | None = None
        self.chunked = False
        self.head_end = -1
        self.done = False
        self._pos = 0  # chunked: where the next chunk-size line starts

    def feed(self, data: bytes) -> None:
        self.buf += data
        if self.head_end < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_end = end + 4
            head = self.buf[:end].decode("latin-1").lower()
            self.status = int(head.split(" ", 2)[1])
            m = re.search(r"\r\ncontent-length:\s*(\d+)", head)
            self.length = int(m.group(1)) if m else None
            self.chunked = "transfer-encoding: chunked" in head
            self._pos = self.head_end
        if self.chunked:
            self._scan_chunks()
        elif self.length is not None:
            self.done = len(self.buf) - self.head_end >= self.length
        else:
            raise RuntimeError("response without length: the bench needs keep-alive")

    def _scan_chunks(self) -> None:
        while True:
            line_end = self.buf.find(b"\r\n", self._pos)
            if line_end < 0:
                return
            size = int(self.buf[self._pos : line_end].split(b";")[0], 16)
            if size == 0:
                self.done = self.buf.endswith(b"\r\n\r\n") and len(self.buf) >= line_end + 4
                return
            nxt = line_end + 2 + size + 2
            if len(self.buf) < nxt:
                return
            self._pos = nxt

    @property
    def body(self) -> bytes:
        return self.buf[self.head_end :]


class Conn:
    """One keep-alive connection; `call` returns seconds to the response's last byte."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, payload: bytes) -> tuple[float, Response]:
        t0 = time.perf_counter()
        self.sock.sendall(payload)
        resp = Response()
        while not resp.done:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"port {self.port} closed the connection")
            resp.feed(data)
        return time.perf_counter() - t0, resp

    def close(self) -> None:
        self.sock.close()


# -- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited:\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_gpulane(
    tmp: Path,
    upstream_port: int,
    synchronous: str,
    db: str | None = None,
    slots: int = 32,
) -> tuple[subprocess.Popen[bytes], int]:
    """`gpulane serve` on `db` (a path or URL; default tmp/gpulane.db)."""
    config = tmp / "config.yaml"
    wide_port = free_port()  # startPort + 1 may be taken
    config.write_text(
        textwrap.dedent(
            f"""\
            startPort: {upstream_port}
            logLevel: warn
            database:
              synchronous: {synchronous}
            groups:
              both:
                swap: false
                exclusive: false
                members: [{MODEL}, {WIDE}]
            models:
              {MODEL}:
                cmd: {sys.executable} -c '{FAKE_NODELAY}' --port ${{PORT}} --name {MODEL}
                proxy: http://127.0.0.1:${{PORT}}
              {WIDE}:
                cmd: {sys.executable} -c '{FAKE_NODELAY}' --port {wide_port} --name {WIDE}
                proxy: http://127.0.0.1:{wide_port}
                concurrencyLimit: {slots}
            """
        )
    )
    port = free_port()
    log = tmp / "gpulane.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--config", str(config)]
        + ["--listen", f"127.0.0.1:{port}", "--db", db or str(tmp / "gpulane.db")],
        cwd=REPO,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    wait_port(port, proc, log)
    return proc, port


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream fake {{ server 127.0.0.1:{upstream}; keepalive 16; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(tmp: Path, upstream_port: int) -> tuple[subprocess.Popen[bytes], int] | None:
    nginx = shutil.which("nginx")
    if nginx is None:
        return None
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, upstream=upstream_port, port=port))
    log = tmp / "nginx.out"
    proc = subprocess.Popen(
        [nginx, "-p", str(tmp), "-c", str(conf)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    wait_port(port, proc, log)
    return proc, port


# -- 1. added latency ------------------------------------------------------------------------


@dataclass
class Samples:
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, target: str, kind: str, s: float) -> None:
        self.seconds.setdefault((target, kind), []).append(s)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def added_latency(ports: dict[str, int], rounds: int, warmup: int) -> Samples:
    plain = json.dumps(CHAT).encode()
    streamed = json.dumps(CHAT | {"stream": True, "fake": {"chunks": STREAM_CHUNKS}}).encode()
    payloads = {
        (target, kind): request_bytes(port, "/v1/chat/completions", body)
        for target, port in ports.items()
        for kind, body in (("plain", plain), ("stream", streamed))
    }
    conns = {target: Conn(port) for target, port in ports.items()}
    samples = Samples()
    rng = random.Random(1)
    order = list(payloads)
    try:
        for i in range(warmup + rounds):
            rng.shuffle(order)
            for target, kind in order:
                seconds, resp = conns[target].call(payloads[target, kind])
                if resp.status != 200 or (kind == "stream" and b"[DONE]" not in resp.body):
                    raise RuntimeError(f"{target} {kind}: HTTP {resp.status} {resp.body[:300]!r}")
                if i >= warmup:
                    samples.add(target, kind, seconds)
    finally:
        for conn in conns.values():
            conn.close()
    return samples


def report_latency(samples: Samples, targets: list[str]) -> None:
    print("\nadded latency (ms; one request at a time, keep-alive, raw-socket client)")
    print(f"  {'':8} {'target':8} {'p50':>8} {'p99':>8} {'added p50':>10} {'added p99':>10}")
    for kind in ("plain", "stream"):
        direct = samples.seconds["direct", kind]
        d50, d99 = pct(direct, 50) * 1e3, pct(direct, 99) * 1e3
        for target in targets:
            values = samples.seconds[target, kind]
            p50, p99 = pct(values, 50) * 1e3, pct(values, 99) * 1e3
            added = "" if target == "direct" else f"{p50 - d50:10.3f} {p99 - d99:10.3f}"
            print(f"  {kind:8} {target:8} {p50:8.3f} {p99:8.3f} {added}")
    print(f"  ({len(samples.seconds['direct', 'plain'])} requests per target and kind)")


# -- 2. dispatch gap ---------------------------------------------------------------------------


async def _one(port: int, payload: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        resp = Response()
        while not resp.done:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed")
            resp.feed(data)
        return resp.status
    finally:
        writer.close()


def queue_depth(port: int) -> float:
    conn = Conn(port)
    try:
        head = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        _, resp = conn.call(head)
    finally:
        conn.close()
    text = resp.body.decode()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^llamaswap_scheduler_queue_depth\{[^}]*\} (\S+)$", text, re.M)
    )


async def dispatch_gap(port: int, queued: int) -> tuple[float, float]:
    hang = request_bytes(
        port, "/v1/chat/completions", json.dumps(CHAT | {"fake": {"hang": True}}).encode()
    )
    blocker = socket.create_connection(("127.0.0.1", port))
    blocker.sendall(hang)
    await asyncio.sleep(0.3)
    payload = request_bytes(port, "/v1/chat/completions", json.dumps(CHAT).encode())
    tasks = []
    for _ in range(queued):
        tasks.append(asyncio.ensure_future(_one(port, payload)))
        await asyncio.sleep(0)  # let each connect, rather than 1000 SYNs at once
    deadline = time.monotonic() + 120
    while await asyncio.to_thread(queue_depth, port) < queued:
        if time.monotonic() > deadline:
            raise RuntimeError("the clients did not all queue within 120 s")
        await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    blocker.close()  # the long job's client leaves: the queue starts draining
    statuses = await asyncio.gather(*tasks)
    drained = time.perf_counter() - t0
    bad = [s for s in statuses if s != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} queued requests failed: {bad[:5]}")
    return t0, drained


def _query(db: Path | str, sql: str, since_wall: float) -> list[Any]:
    """Rows of `sql` (`:since` bound) on the database `db`, a path or URL."""
    engine = sqlalchemy.create_engine(database_url(db))
    try:
        with engine.connect() as conn:
            return list(conn.execute(sqlalchemy.text(sql), {"since": since_wall}))
    finally:
        engine.dispose()


def gaps_from_events(db: Path | str, since_wall: float) -> list[float]:
    """request_completed -> next request_started, in ms, in order of seq."""
    rows = _query(
        db,
        "SELECT type, data FROM events WHERE type IN ('request_started', 'request_completed',"
        " 'request_cancelled') AND at >= :since ORDER BY seq",
        since_wall,
    )
    gaps = []
    last_end: int | None = None
    for kind, data in rows:
        at = json.loads(data)["at"]
        if kind == "request_started" and last_end is not None:
            gaps.append((at - last_end) / 1e6)
            last_end = None
        elif kind != "request_started":
            last_end = at
    return gaps


def wait_db_quiet(
    db: Path | str, expected_completed: int, since_wall: float, timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        [(n,)] = _query(
            db,
            "SELECT count(*) FROM events WHERE type='request_completed' AND at >= :since",
            since_wall,
        )
        if n >= expected_completed:
            return
        time.sleep(0.1)


# -- 3. throughput -------------------------------------------------------------------------------


async def throughput(port: int, clients: int, seconds: float) -> int:
    """Requests completed by `clients` closed-loop clients in `seconds`."""
    body = {"model": WIDE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    payload = request_bytes(port, "/v1/chat/completions", json.dumps(body).encode())
    stop_at = time.perf_counter() + seconds

    async def client() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        done = 0
        try:
            while time.perf_counter() < stop_at:
                writer.write(payload)
                resp = Response()
                while not resp.done:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed")
                    resp.feed(data)
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status} {resp.body[:300]!r}")
                done += 1
        finally:
            writer.close()
        return done

    return sum(await asyncio.gather(*(client() for _ in range(clients))))


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=2000, help="timed requests per target and kind"
    )
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--queued", type=int, default=1000, help="clients queued for the gap")
    parser.add_argument("--clients", type=int, default=32, help="clients (and slots) for 3.")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of 3.")
    parser.add_argument("--no-gap", action="store_true", help="skip 2. (the dispatch gap)")
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument("--no-nginx", action="store_true", help="skip nginx even if installed")
    parser.add_argument("--keep", type=Path, help="keep the db and logs in this directory")
    args = parser.parse_args()

    with ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep.resolve()
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpulane-bench-")))
        upstream_port = free_port()
        gw, gw_port = start_gpulane(tmp, upstream_port, args.synchronous, slots=args.clients)
        stack.callback(stop, gw)
        # The first request loads the model (a swap), then the upstream is there to call.
        conn = Conn(gw_port)
        _, resp = conn.call(
            request_bytes(gw_port, "/v1/chat/completions", json.dumps(CHAT).encode())
        )
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"loading {MODEL} failed: {resp.status} {resp.body[:500]!r}")
        ports = {"direct": upstream_port, "gpulane": gw_port}
        nginx = None if args.no_nginx else start_nginx(tmp, upstream_port)
        if nginx is not None:
            nginx_state = "yes"
        else:
            nginx_state = "skipped (--no-nginx)" if args.no_nginx else "not installed, skipped"
        if nginx is not None:
            stack.callback(stop, nginx[0])
            ports["nginx"] = nginx[1]
        print(f"gpulane pid {gw.pid} (py-spy record -p {gw.pid} to profile)", flush=True)
        print(
            f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, db synchronous="
            f"{args.synchronous}, nginx: {nginx_state}"
        )

        cpu0, wall0 = cpu_seconds(gw.pid), time.perf_counter()
        samples = added_latency(ports, args.rounds, args.warmup)
        cpu = cpu_seconds(gw.pid) - cpu0
        wall = time.perf_counter() - wall0
        report_latency(samples, list(ports))
        served = 2 * (args.rounds + args.warmup)
        print(
            f"  gpulane CPU: {cpu / served * 1e6:.0f} us per request (user+sys, all threads;"
            f" {cpu / wall * 100:.0f}% of one core during the run); load average"
            f" {os.getloadavg()[0]:.2f}"
        )

        asyncio.run(throughput(gw_port, args.clients, 1.0))  # loads `wide`, warms up
        cpu0, wall0 = cpu_seconds(gw.pid), time.perf_counter()
        done = asyncio.run(throughput(gw_port, args.clients, args.seconds))
        cpu, wall = cpu_seconds(gw.pid) - cpu0, time.perf_counter() - wall0
        print(
            f"\nthroughput ({args.clients} clients, small requests, a model with"
            f" {args.clients} slots): {done / wall:.0f} requests/s; gpulane CPU"
            f" {cpu / done * 1e6:.0f} us per request"
        )
        if args.no_gap:
            return

        since = time.time()
        _, drained = asyncio.run(dispatch_gap(gw_port, args.queued))
        wait_db_quiet(tmp / "gpulane.db", args.queued, since)
        gaps = gaps_from_events(tmp / "gpulane.db", since)
        print(
            f"\ndispatch gap ({args.queued} clients queued; request_completed -> next "
            "request_started, from the events table)"
        )
        if gaps:
            print(
                f"  gaps {len(gaps)}  p50 {pct(gaps, 50):.3f} ms  p99 {pct(gaps, 99):.3f} ms"
                f"  max {max(gaps):.3f} ms  mean {statistics.fmean(gaps):.3f} ms"
            )
        print(f"  drain: {args.queued} requests in {drained:.2f} s ({args.queued / drained:.0f}/s)")
        added50 = pct(samples.seconds["gpulane", "plain"], 50) - pct(
            samples.seconds["direct", "plain"], 50
        )
        added99 = pct(samples.seconds["gpulane", "plain"], 99) - pct(
            samples.seconds["direct", "plain"], 99
        )
        print(
            f"\ntargets: added p50 {added50 * 1e3:.3f} ms (< {TARGETS['added_p50_ms']}), "
            f"added p99 {added99 * 1e3:.3f} ms (< {TARGETS['added_p99_ms']}), "
            f"gap p99 {pct(gaps, 99) if gaps else float('nan'):.3f} ms (< {TARGETS['gap_p99_ms']})"
        )


if __name__ == "__main__":
    main()
