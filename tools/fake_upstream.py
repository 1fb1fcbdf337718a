"""A fake OpenAI-compatible inference server for tests and benchmarks.

    python -m tools.fake_upstream --port N [--name NAME] [--start-delay S]
                                  [--exit-at-start] [--fail-start-with TEXT ...]
                                  [--health-status CODE]
                                  [--spawn-setsid-child]
                                  [--gpu-dir DIR --gpu-mib N [--gpu-release-after S|never]]

Standard library only, so it starts in tens of milliseconds. Each request may
steer the reply with a ``"fake"`` object in its JSON body or an ``X-Fake``
header holding the same JSON (the header wins field by field):

    {"delay": s, "reply": "text", "chunks": n, "chunk_delay": s,
     "die_mid_stream": true, "hang": true, "status": code, "digest": true,
     "hold_file": path, "die_with": "text"}

``die_with`` prints that text (a line of a real server's, say its "CUDA out of
memory") to stderr and exits at once, with no answer: a server dying mid-request.

``hold_file`` holds the answer until that file exists (at most 120 s), so a
test decides when a request ends instead of guessing how long a delay lasts.

``digest`` answers ``{"received_bytes": n, "received_sha256": hex}`` of the
request body exactly as it arrived, so a test can check that large bodies pass
through unchanged without getting them back.

It answers `/v1/chat/completions`, `/v1/completions` (streamed or not),
`/v1/embeddings` and `/v1/responses` (the Responses API's shape, one output
message, not streamed) in OpenAI's shapes, and echoes any other request.

Every reply names the server (``served_by`` field, ``X-Served-By`` header) and
echoes the ``model`` it received, so tests can tell which upstream served them.
One line per request goes to stdout so log capture can be tested.

``--gpu-dir DIR --gpu-mib N`` takes N MiB of a fake GPU shared by files
(app/runtime/gpu_file.py; `gpulane serve` reads it with
``GPULANE_FAKE_GPU=DIR:TOTAL_MIB``) at start and gives it back at SIGTERM, or
``--gpu-release-after S`` seconds later (``never``: a driver that never frees it).

``--fail-start-with TEXT`` (repeatable) prints each TEXT as a line to stderr
while it starts, then exits with code 1 before it listens: a server whose load
fails, as llama.cpp or vLLM do with their out-of-memory lines.

``--spawn-setsid-child`` leaves a copy of the server behind as a daemonizing
helper would (fork, ``setsid``, fork again, the middle process exits): the copy
is in a session and process group of its own, its parent is gone, and it keeps
serving the same listening socket until it is signalled itself. Its replies
name it ``NAME/setsid-child``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

EXIT_AT_START_CODE = 3
DIE_MID_STREAM_CODE = 1
FAIL_START_CODE = 1
DEFAULT_CHUNKS = 4

_stdout_lock = threading.Lock()
_gpu_release: tuple[str, int, int, float | None] | None = None
"""How this process gives back its fake GPU memory (`--gpu-dir`), once set."""


def log(line: str) -> None:
    # Flushed at once: the process manager captures this through a pipe.
    with _stdout_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class Behaviour:
    """What one request asked the fake to do."""

    delay: float = 0.0
    hold_file: str | None = None
    reply: str | None = None
    chunks: int = DEFAULT_CHUNKS
    chunk_delay: float = 0.0
    die_mid_stream: bool = False
    hang: bool = False
    status: int | None = None
    digest: bool = False
    die_with: str | None = None

    @classmethod
    def parse(cls, *sources: Any) -> Behaviour:
        merged: dict[str, Any] = {}
        for source in sources:
            if isinstance(source, dict):
                merged.update(source)
        status = merged.get("status")
        return cls(
            delay=float(merged.get("delay") or 0),
            hold_file=None if merged.get("hold_file") is None else str(merged["hold_file"]),
            reply=None if merged.get("reply") is None else str(merged["reply"]),
            chunks=max(1, int(merged.get("chunks") or DEFAULT_CHUNKS)),
            chunk_delay=float(merged.get("chunk_delay") or 0),
            die_mid_stream=bool(merged.get("die_mid_stream")),
            hang=bool(merged.get("hang")),
            status=None if status is None else int(status),
            digest=bool(merged.get("digest")),
            die_with=None if merged.get("die_with") is None else str(merged["die_with"]),
        )


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, name: str, ready_at: float, health: int):
        super().__init__(address, FakeHandler)
        self.name = name
        self.ready_at = ready_at
        self.health_status = health


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every reply has a length or is chunked
    server_version = "fake-upstream/1"
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # replaced by the one-line log in _dispatch

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_GET

    # -- dispatch -------------------------------------------------------------

    def _dispatch(self) -> None:
        name = self.server.name
        try:
            raw = self._read_body()
            payload = _json_or_none(raw)
            body = payload if isinstance(payload, dict) else {}
            model = body.get("model")
            try:
                header = json.loads(self.headers.get("X-Fake") or "null")
                fake = Behaviour.parse(body.get("fake"), header)
            except (ValueError, TypeError) as exc:
                self._send_json(400, _error(f"bad fake options: {exc}", 400), model)
                return
            log(f"{name} handled {self.command} {self.path}")
            self._respond(urlsplit(self.path).path, raw, body, model, fake)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; nothing left to say

    def _respond(
        self, path: str, raw: bytes, body: dict[str, Any], model: Any, fake: Behaviour
    ) -> None:
        if fake.delay:
            time.sleep(fake.delay)
        if fake.hold_file:
            deadline = time.monotonic() + 120
            while not os.path.exists(fake.hold_file) and time.monotonic() < deadline:
                time.sleep(0.02)
        if fake.die_with is not None:
            print(fake.die_with, file=sys.stderr, flush=True)
            if _gpu_release is not None:  # an exit frees a process's GPU memory
                _gpu_give_back(*_gpu_release)
            os._exit(DIE_MID_STREAM_CODE)
        if fake.hang:
            self._hang_until_disconnect()
            return
        if fake.status is not None:
            self._send_json(fake.status, _error(f"fake status {fake.status}", fake.status), model)
            return
        if fake.digest:
            received = {
                "received_bytes": len(raw),
                "received_sha256": hashlib.sha256(raw).hexdigest(),
            }
            self._send_json(200, received, model)
            return
        loading = time.monotonic() < self.server.ready_at
        if loading:
            # Like llama-server while it loads a model: everything answers 503.
            self._send_json(503, _error("Loading model", 503) | {"status": "loading"}, model)
            return
        if path == "/health" and self.command in ("GET", "HEAD"):
            code = self.server.health_status
            self._send_json(code, {"status": "ok" if code == 200 else "unhealthy"}, model)
        elif path == "/v1/chat/completions" and self.command == "POST":
            self._completion(body, model, fake, chat=True)
        elif path == "/v1/completions" and self.command == "POST":
            self._completion(body, model, fake, chat=False)
        elif path == "/v1/embeddings" and self.command == "POST":
            self._embeddings(body, model)
        elif path == "/v1/responses" and self.command == "POST":
            self._response(body, model, fake)
        else:
            self._echo(raw, model)

    # -- endpoints -----------------------------------------------------------

    def _completion(self, body: dict[str, Any], model: Any, fake: Behaviour, *, chat: bool) -> None:
        started = time.monotonic()
        if chat:
            messages = body.get("messages") or []
            prompt = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        else:
            prompt = str(body.get("prompt", ""))
        reply = fake.reply if fake.reply is not None else f"Hello from {self.server.name}."
        prompt_n = max(1, len(prompt.split()))
        predicted_n = max(1, len(reply.split()))
        kind = "chat.completion" if chat else "text_completion"
        prefix = "chatcmpl" if chat else "cmpl"
        common = {
            "id": f"{prefix}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": model,
            "served_by": self.server.name,
        }

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if body.get("stream"):
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "finish_reason": finish}

        def accounting() -> dict[str, Any]:
            elapsed_ms = max(1.0, (time.monotonic() - started) * 1000)
            return {
                "usage": {
                    "prompt_tokens": prompt_n,
                    "completion_tokens": predicted_n,
                    "total_tokens": prompt_n + predicted_n,
                },
                "timings": {
                    "prompt_n": prompt_n,
                    "prompt_ms": 1.0,
                    "prompt_per_second": prompt_n * 1000.0,
                    "predicted_n": predicted_n,
                    "predicted_ms": elapsed_ms,
                    "predicted_per_second": predicted_n * 1000.0 / elapsed_ms,
                },
            }

        if not body.get("stream"):
            result = common | {"object": kind, "choices": [choice(reply, "stop")]} | accounting()
            self._send_json(200, result, model)
            return

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        self._start_chunked("text/event-stream")
        pieces = _split(reply, fake.chunks)
        die_at = len(pieces) // 2 if fake.die_mid_stream else None
        for i, piece in enumerate(pieces):
            if i and fake.chunk_delay:
                time.sleep(fake.chunk_delay)
            if i == die_at:
                log(f"{self.server.name} dying mid-stream after {i} chunks")
                os._exit(DIE_MID_STREAM_CODE)
            chunk = common | {"object": chunk_kind, "choices": [choice(piece, None)]}
            self._write_chunk(_sse(chunk))
        final = common | {"object": chunk_kind, "choices": [choice(None, "stop")]} | accounting()
        self._write_chunk(_sse(final))
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _embeddings(self, body: dict[str, Any], model: Any) -> None:
        items = body.get("input", "")
        if not isinstance(items, list) or (items and isinstance(items[0], int)):
            items = [items]  # one string, or one list of token ids
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(item)}
            for i, item in enumerate(items)
        ]
        tokens = sum(max(1, len(str(item).split())) for item in items)
        result = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "served_by": self.server.name,
        }
        self._send_json(200, result, model)

    def _response(self, body: dict[str, Any], model: Any, fake: Behaviour) -> None:
        """The Responses API's shape (non-streamed): one assistant message."""
        reply = fake.reply if fake.reply is not None else f"Hello from {self.server.name}."
        given = body.get("input", "")
        input_n = max(1, len(str(given).split()))
        output_n = max(1, len(reply.split()))
        message = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": reply, "annotations": []}],
        }
        result = {
            "id": f"resp_{uuid.uuid4().hex[:24]}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": model,
            "output": [message],
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": True,
            "temperature": body.get("temperature"),
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p"),
            "background": body.get("background", False),
            "usage": {
                "input_tokens": input_n,
                "output_tokens": output_n,
                "total_tokens": input_n + output_n,
            },
        }
        self._send_json(200, result, model)

    def _echo(self, raw: bytes, model: Any) -> None:
        result = {
            "method": self.command,
            "path": self.path,
            "headers": dict(self.headers.items()),
            "body": raw.decode("utf-8", errors="replace"),
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "model": model,
            "served_by": self.server.name,
        }
        self._send_json(200, result, model)

    def _hang_until_disconnect(self) -> None:
        # Never answer; return once the client closes so the thread ends.
        conn = self.connection
        while True:
            readable, _, _ = select.select([conn], [], [], 0.5)
            if not readable:
                continue
            try:
                if not conn.recv(1, socket.MSG_PEEK):
                    break
            except OSError:
                break
            time.sleep(0.5)  # pipelined bytes, not a close: keep hanging without spinning
        self.close_connection = True

    # -- wire ------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline(65537).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send_json(self, status: int, result: dict[str, Any], model: Any) -> None:
        result.setdefault("served_by", self.server.name)
        result.setdefault("model", model)
        data = json.dumps(result).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Served-By", self.server.name)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Served-By", self.server.name)
        self.end_headers()

    def _write_chunk(self, data: bytes) -> None:
        # wfile is unbuffered, so each chunk leaves at once.
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _error(message: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "fake_error", "code": code}}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _split(text: str, n: int) -> list[str]:
    # n pieces that join back to text; some are empty when text is short.
    return [text[i * len(text) // n : (i + 1) * len(text) // n] for i in range(n)]


def _vector(item: Any, dims: int = 8) -> list[float]:
    digest = hashlib.sha256(json.dumps(item).encode()).digest()
    return [round(b / 127.5 - 1.0, 6) for b in digest[:dims]]


def _leave_setsid_copy(server: FakeServer) -> None:
    # Called before serve_forever, while this process has one thread: fork is safe.
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)  # the copy's parent is gone once this returns
        return
    try:
        os.setsid()  # out of the upstream's session and process group
        if os.fork():
            os._exit(0)
        server.name = f"{server.name}/setsid-child"
        log(f"{server.name} pid={os.getpid()} sid={os.getsid(0)} serving port {server.server_port}")
        server.serve_forever(poll_interval=0.5)
    finally:
        os._exit(0)


def _gpu_hold(directory: str, pid: int, entry: dict[str, float]) -> None:
    """One file per holder, as app/runtime/gpu_file.py reads them (stdlib only here)."""
    path = os.path.join(directory, f"{pid}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(entry, f)
    os.replace(path + ".tmp", path)


def _gpu_give_back(directory: str, pid: int, mib: int, after: float | None) -> None:
    if after is None:
        return  # never freed
    if after <= 0:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, f"{pid}.json"))
        return
    _gpu_hold(directory, pid, {"mib": mib, "free_at": time.time() + after})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.fake_upstream", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="fake")
    parser.add_argument("--start-delay", type=float, default=0.0, help="answer 503 until then")
    parser.add_argument("--exit-at-start", action="store_true", help=f"exit {EXIT_AT_START_CODE}")
    parser.add_argument(
        "--fail-start-with",
        action="append",
        default=[],
        metavar="TEXT",
        help="print TEXT to stderr while starting, then exit 1 (repeatable: one line each)",
    )
    parser.add_argument("--health-status", type=int, default=200, help="GET /health status")
    parser.add_argument(
        "--spawn-setsid-child",
        action="store_true",
        help="leave a daemonized copy serving the port, in a new session",
    )
    parser.add_argument("--gpu-dir", help="a fake GPU shared by files (app/runtime/gpu_file.py)")
    parser.add_argument("--gpu-mib", type=int, default=0, help="memory it takes in --gpu-dir")
    parser.add_argument(
        "--gpu-release-after",
        default="0",
        help="seconds after its exit its memory is free again, or `never` (default 0)",
    )
    args = parser.parse_args(argv)

    name = args.name
    log(f"{name} starting pid={os.getpid()} port={args.port}")
    release = None
    if args.gpu_dir and args.gpu_mib:
        _gpu_hold(args.gpu_dir, os.getpid(), {"mib": args.gpu_mib})
        after = None if args.gpu_release_after == "never" else float(args.gpu_release_after)
        release = (args.gpu_dir, os.getpid(), args.gpu_mib, after)
        global _gpu_release
        _gpu_release = release
    if args.exit_at_start:
        print(f"{name} error: exiting at start as asked", file=sys.stderr, flush=True)
        sys.exit(EXIT_AT_START_CODE)
    if args.fail_start_with:
        for line in args.fail_start_with:
            print(line, file=sys.stderr, flush=True)
        if release is not None:
            _gpu_give_back(*release)
        sys.exit(FAIL_START_CODE)

    def on_sigterm(signum: int, frame: object) -> None:
        log(f"{name} received SIGTERM, exiting")
        if release is not None:
            _gpu_give_back(*release)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    ready_at = time.monotonic() + args.start_delay
    server = FakeServer(
        (args.host, args.port), name=name, ready_at=ready_at, health=args.health_status
    )
    if args.spawn_setsid_child:
        _leave_setsid_copy(server)
    log(f"{name} listening on http://{args.host}:{server.server_port} pid={os.getpid()}")
    server.serve_forever(poll_interval=0.5)


if __name__ == "__main__":
    main()
