"""A fake model server that sleeps as vLLM or SGLang does, for tests and benchmarks.

    python -m tools.fake_sleeper --port N [--kind vllm|sglang] [--name NAME]
        [--start-delay S] [--sleep-time S] [--sleep-hold-file PATH] [--wake-time S]
        [--sleep-fails] [--wake-hangs] [--log FILE]

Everything `tools.fake_upstream` answers, plus the server's sleep endpoints as
the real ones behave (read from their source):

- vLLM (`vllm/entrypoints/serve/sleep/api_router.py`, served with
  `VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode`): `POST /sleep?level=1|2`
  answers 200 with no body once the engine sleeps; `POST /wake_up` (optional
  `tags=weights` / `tags=kv_cache`, each waking that part) answers 200 with no
  body; `GET /is_sleeping` answers `{"is_sleeping": bool}`, true until every
  part is awake; `POST /collective_rpc` (`reload_weights` after a level-2 wake)
  answers 200. While asleep, the inference endpoints answer 503.
- SGLang (`python/sglang/srt/entrypoints/http_server.py`, served with
  `--enable-memory-saver`): `POST /release_memory_occupation` and
  `POST /resume_memory_occupation` answer 200 `{"success": true, "message": ...}`,
  or 400 `{"success": false, ...}` when the engine refused.

`--start-delay` is the cold start (503 until then, as a loading server);
`--sleep-time` and `--wake-time` how long a sleep and a wake take; with
`--sleep-hold-file`, a sleep lasts until that file exists too (at most 120 s), so
a test decides when it ends instead of guessing. `--sleep-fails`
answers every sleep with an error (vLLM: 500, SGLang: 400 with success false) and
stays awake; `--wake-hangs` never answers a wake. `--log` appends one JSON line
per start, sleep, wake and exit (`{"ev", "t", "pid", "name", ...}`) so a test or
benchmark can count cold starts and read each sleep's and wake's time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tools.fake_upstream import Behaviour, FakeHandler, FakeServer, _error, log

PARTS = ("weights", "kv_cache")
# vLLM's protected endpoints: they need the weights, so a sleeping engine refuses them.
NEEDS_WEIGHTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class SleeperServer(FakeServer):
    def __init__(self, address: tuple[str, int], args: argparse.Namespace, ready_at: float):
        super().__init__(address, name=args.name, ready_at=ready_at, health=200)
        self.RequestHandlerClass = SleeperHandler
        self.args = args
        self.asleep: set[str] = set()
        """The parts released (vLLM's tags); empty: awake."""
        self.lock = threading.Lock()

    def record(self, ev: str, **fields: Any) -> None:
        path = self.args.log
        line = json.dumps(
            {"ev": ev, "t": time.time(), "pid": os.getpid(), "name": self.name, **fields}
        )
        log(f"{self.name} {ev} {json.dumps(fields)}")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")


class SleeperHandler(FakeHandler):
    server: SleeperServer

    def _respond(
        self, path: str, raw: bytes, body: dict[str, Any], model: Any, fake: Behaviour
    ) -> None:
        server, args = self.server, self.server.args
        query = parse_qs(urlsplit(self.path).query)
        if args.kind == "vllm" and self.command == "POST" and path == "/sleep":
            self._vllm_sleep(int((query.get("level") or ["1"])[0]))
        elif args.kind == "vllm" and self.command == "POST" and path == "/wake_up":
            self._vllm_wake(query.get("tags") or list(PARTS))
        elif args.kind == "vllm" and self.command == "GET" and path == "/is_sleeping":
            self._send_json(200, {"is_sleeping": bool(server.asleep)}, model)
        elif args.kind == "vllm" and self.command == "POST" and path == "/collective_rpc":
            self._send_json(200, {"results": [None]}, model)
        elif args.kind == "sglang" and path == "/release_memory_occupation":
            self._sglang_release(model)
        elif args.kind == "sglang" and path == "/resume_memory_occupation":
            self._sglang_resume(model)
        elif server.asleep and path in NEEDS_WEIGHTS:
            self._send_json(503, _error("model is sleeping", 503), model)
        else:
            super()._respond(path, raw, body, model, fake)

    def _vllm_sleep(self, level: int) -> None:
        server = self.server
        if server.args.sleep_fails:
            server.record("sleep_failed", level=level)
            self._send_json(500, {"detail": "Internal Server Error"}, None)
            return
        t0 = time.monotonic()
        with server.lock:
            _sleep_lasts(server.args)
            server.asleep = set(PARTS)
        server.record("sleep", level=level, s=time.monotonic() - t0)
        self._empty(200)

    def _vllm_wake(self, tags: list[str]) -> None:
        server = self.server
        if server.args.wake_hangs:
            server.record("wake_hung")
            self._hang_until_disconnect()
            return
        t0 = time.monotonic()
        with server.lock:
            if server.asleep & set(tags):
                time.sleep(server.args.wake_time / len(PARTS) * len(server.asleep & set(tags)))
            server.asleep -= set(tags)
        if not server.asleep:
            server.record("wake", s=time.monotonic() - t0)
        self._empty(200)

    def _sglang_release(self, model: Any) -> None:
        server = self.server
        if server.args.sleep_fails:
            server.record("sleep_failed")
            self._send_json(400, {"success": False, "message": "release failed"}, model)
            return
        t0 = time.monotonic()
        with server.lock:
            _sleep_lasts(server.args)
            server.asleep = set(PARTS)
        server.record("sleep", s=time.monotonic() - t0)
        self._send_json(200, {"success": True, "message": "released"}, model)

    def _sglang_resume(self, model: Any) -> None:
        server = self.server
        if server.args.wake_hangs:
            server.record("wake_hung")
            self._hang_until_disconnect()
            return
        t0 = time.monotonic()
        with server.lock:
            time.sleep(server.args.wake_time)
            server.asleep = set()
        server.record("wake", s=time.monotonic() - t0)
        self._send_json(200, {"success": True, "message": "resumed"}, model)

    def _empty(self, status: int) -> None:
        # vLLM's sleep and wake_up answer `Response(status_code=200)`: no body.
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _sleep_lasts(args: argparse.Namespace) -> None:
    """A sleep's time: `--sleep-time`, then until `--sleep-hold-file` exists."""
    time.sleep(args.sleep_time)
    deadline = time.monotonic() + 120
    while args.sleep_hold_file and not os.path.exists(args.sleep_hold_file):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.fake_sleeper", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="sleeper")
    parser.add_argument("--kind", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--start-delay", type=float, default=0.0, help="cold start: 503 until then")
    parser.add_argument("--sleep-time", type=float, default=0.0, help="seconds a sleep takes")
    parser.add_argument(
        "--sleep-hold-file", default="", help="a sleep lasts until this file exists too"
    )
    parser.add_argument("--wake-time", type=float, default=0.0, help="seconds a wake takes")
    parser.add_argument("--sleep-fails", action="store_true", help="every sleep answers an error")
    parser.add_argument("--wake-hangs", action="store_true", help="a wake never answers")
    parser.add_argument("--log", default="", help="append a JSON line per start, sleep, wake")
    args = parser.parse_args(argv)

    def on_sigterm(signum: int, frame: object) -> None:
        server.record("exit")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server = SleeperServer((args.host, args.port), args, time.monotonic() + args.start_delay)
    server.record("start", kind=args.kind, start_delay=args.start_delay)
    log(f"{args.name} listening on http://{args.host}:{server.server_port} pid={os.getpid()}")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    main()
