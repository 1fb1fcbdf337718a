#!/usr/bin/env python3
"""The GPU bench's model server: real GPU work without model weights (bench/gpu_bench.py).

    python3 bench/gpu_upstream.py --port N --gib G --name NAME --log FILE [--pin-at-start]

It fills `--gib` GiB of GPU memory with bf16 "weights" before `/health` answers
(its cold start: importing PyTorch, allocating, writing them), and each chat
completion runs `max_tokens` decode steps that each read every weight once
(memory-bound, as a real decode is). It speaks vLLM's sleep endpoints as vLLM
does (`POST /sleep?level=1` copies the weights to pinned host memory and frees
the GPU's, `POST /wake_up` copies them back, `GET /is_sleeping`); a chat while
asleep gets 503. The pinned host buffers stay after a wake (vLLM's CuMemAllocator
keeps its CPU backup too), so the next sleep does not allocate them again;
`--pin-at-start` allocates them during the cold start. Each load, sleep, wake
and request's GPU interval is a JSON line in `--log`: the bench's ground truth.
Standard library and PyTorch only: a GPU machine may have nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DIM = 8192  # one weight matrix: DIM x DIM bf16 = 128 MiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--gib", type=float, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--pin-at-start", action="store_true")
    args = ap.parse_args()

    def record(**fields: Any) -> None:
        fields.update(t=time.time(), name=args.name, pid=os.getpid())
        with open(args.log, "a") as f:
            f.write(json.dumps(fields) + "\n")

    t0 = time.time()
    import torch  # its import is part of the cold start

    imported = time.time()
    device = torch.device("cuda")
    count = max(1, int(args.gib * (1 << 30) // (DIM * DIM * 2)))
    try:
        weights = [
            torch.empty((DIM, DIM), dtype=torch.bfloat16, device=device).normal_(0, 0.01)
            for _ in range(count)
        ]
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as exc:  # another model still holds the GPU
        record(ev="oom", error=str(exc)[:300], free=torch.cuda.mem_get_info()[0])
        sys.exit(3)
    x0 = torch.randn((1, DIM), dtype=torch.bfloat16, device=device)
    lock = threading.Lock()
    host: list[Any] = []
    state = {"asleep": False}
    if args.pin_at_start:
        host += [torch.empty((DIM, DIM), dtype=torch.bfloat16, pin_memory=True) for _ in weights]

    def sleep() -> None:
        with lock:
            if state["asleep"]:
                return
            t = time.time()
            if not host:
                host.extend(
                    torch.empty((DIM, DIM), dtype=torch.bfloat16, pin_memory=True) for _ in weights
                )
            for w, h in zip(weights, host, strict=True):
                h.copy_(w, non_blocking=True)
            torch.cuda.synchronize()
            weights.clear()
            torch.cuda.empty_cache()
            state["asleep"] = True
            record(ev="sleep", s=time.time() - t)

    def wake() -> None:
        with lock:
            if not state["asleep"]:
                return
            t = time.time()
            weights.extend(h.to(device, non_blocking=True) for h in host)
            torch.cuda.synchronize()
            state["asleep"] = False
            record(ev="wake", s=time.time() - t)

    def decode(steps: int) -> tuple[float, float]:
        with lock:
            start = time.time()
            x = x0
            for _ in range(steps):
                for w in weights:
                    x = torch.tanh(x @ w)
            torch.cuda.synchronize()
            return start, time.time()

    record(
        ev="ready",
        import_s=imported - t0,
        load_s=time.time() - t0,
        gib=count * DIM * DIM * 2 / (1 << 30),
        pinned=bool(host),
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def _send(self, code: int, obj: Any | None) -> None:
            body = b"" if obj is None else json.dumps(obj).encode()
            head = f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            self.wfile.write(head.encode() + body)  # one write: no Nagle/delayed-ACK stall

        def do_GET(self) -> None:
            if self.path.startswith("/is_sleeping"):
                self._send(200, {"is_sleeping": state["asleep"]})
            elif self.path.startswith("/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.startswith("/sleep"):
                sleep()
                return self._send(200, None)  # vLLM answers an empty 200
            if self.path.startswith("/wake_up"):
                wake()
                return self._send(200, None)
            if state["asleep"]:
                error = {"message": "model is sleeping", "type": "server_error"}
                return self._send(503, {"error": error})
            body = json.loads(raw or b"{}")
            steps = int(body.get("max_tokens") or 16)
            tag = str((body.get("messages") or [{}])[-1].get("content", ""))
            start, end = decode(steps)
            record(ev="work", tag=tag, start=start, end=end, steps=steps)
            message = {"role": "assistant", "content": f"{steps} steps"}
            usage = {"prompt_tokens": 1, "completion_tokens": steps, "total_tokens": steps + 1}
            self._send(
                200,
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": int(end),
                    "model": args.name,
                    "choices": [{"index": 0, "finish_reason": "length", "message": message}],
                    "usage": usage,
                },
            )

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    try:
        server.serve_forever()
    finally:
        record(ev="exit")


if __name__ == "__main__":
    main()
