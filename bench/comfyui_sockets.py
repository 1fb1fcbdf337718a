"""Prompts heard through gpulane's own ComfyUI websocket. Prints figures.

    python -m bench.comfyui_sockets [--prompts 40] [--sockets 4]

`gpulane serve` in front of tools/fake_comfyui.py, as a user starts it. Opens
`--sockets` sockets at `/comfyui/ws?clientId=cN`, posts `--prompts` renders
(0.3 s, 10 steps) at once, each with the `client_id` of one socket in turn,
and reads every socket until each of its prompts' last message. It counts:

- prompts not heard in full on their socket (`execution_start`, 10 `progress`,
  10 previews, `execution_success`, the last `executing`): 0;
- messages of a prompt heard on another socket: 0;
- how long after ComfyUI a message reaches the client through gpulane: the
  fake stamps `execution_start` and `execution_success` with its wall clock
  (ms), as ComfyUI does, and the client notes when it read them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from tests.e2e.gateway import Gateway

STEPS = 10


def config() -> str:
    return (
        "models:\n  comfyui_auto:"
        f"\n    cmd: {sys.executable} -m tools.fake_comfyui --port ${{PORT}}"
        "\n    checkEndpoint: /system_stats\n    maxRunTime: 120\n"
    )


def message_type(message: Any) -> str | None:
    return message.get("type") if isinstance(message, dict) else None


def listen(url: str, ready: Any, wanted: Any) -> list[tuple[float, Any]]:
    """(read at, message) until every prompt id `wanted()` names has ended here."""
    got: list[tuple[float, Any]] = []
    ended: set[str] = set()
    with connect(url, open_timeout=10, max_size=None) as ws:
        ws.recv(timeout=10)  # the opening status
        ready()
        deadline = time.monotonic() + 300
        while not (ended and ended >= wanted()):
            raw = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            message = raw if isinstance(raw, bytes) else json.loads(raw)
            got.append((time.time() * 1000, message))
            data = message.get("data") if isinstance(message, dict) else None
            if message_type(message) == "executing" and data["node"] is None:  # its last
                ended.add(data["prompt_id"])
    return got


def run(gw: Gateway, prompts: int, sockets: int) -> list[str]:
    base = gw.url.replace("http", "ws", 1) + "/comfyui/ws?clientId="
    mine: dict[str, set[str]] = {f"c{n}": set() for n in range(sockets)}
    opened: list[str] = []
    posted = False
    t0 = time.monotonic()
    with gw.client() as client, cf.ThreadPoolExecutor(sockets) as pool:
        heard = {
            sid: pool.submit(
                listen,
                base + sid,
                lambda sid=sid: opened.append(sid),
                lambda sid=sid: mine[sid] if posted else {"-"},
            )
            for sid in mine
        }
        deadline = time.monotonic() + 30
        while len(opened) < sockets:
            assert time.monotonic() < deadline, "the sockets did not open"
            time.sleep(0.01)
        for n in range(prompts):
            sid = f"c{n % sockets}"
            workflow = {
                "1": {"class_type": "FakeRender", "inputs": {"seconds": 0.3, "steps": STEPS}},
                "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}},
            }
            r = client.post("/comfyui/prompt", json={"prompt": workflow, "client_id": sid})
            mine[sid].add(r.json()["prompt_id"])
        posted = True
        results = {sid: f.result(timeout=600) for sid, f in heard.items()}
    took = time.monotonic() - t0
    incomplete = 0
    crossed = 0
    delays: list[float] = []
    for sid, got in results.items():
        for prompt_id in mine[sid]:
            of = [
                m for _, m in got if isinstance(m, dict) and m["data"].get("prompt_id") == prompt_id
            ]
            kinds = [m["type"] for m in of]
            full = (
                kinds.count("progress") == STEPS
                and "execution_start" in kinds
                and "execution_success" in kinds
                and kinds[-1] == "executing"
            )
            incomplete += not full
        previews = sum(1 for _, m in got if isinstance(m, bytes))
        incomplete += previews != STEPS * len(mine[sid])
        for at, m in got:
            if not isinstance(m, dict):
                continue
            about = m["data"].get("prompt_id") if isinstance(m["data"], dict) else None
            crossed += about is not None and about not in mine[sid]
            if m["type"] in ("execution_start", "execution_success"):
                delays.append(at - m["data"]["timestamp"])
    delays.sort()
    p95 = delays[int(len(delays) * 0.95) - 1]
    return [
        f"prompts {prompts} on {sockets} sockets, {took:.1f} s",
        f"prompts not heard in full: {incomplete}",
        f"messages heard on another socket: {crossed}",
        f"ComfyUI to client through gpulane ({len(delays)} stamped messages): "
        f"median {statistics.median(delays):.1f} ms, p95 {p95:.1f} ms, max {delays[-1]:.1f} ms",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.comfyui_sockets", description=__doc__)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--sockets", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        gw = Gateway(Path(tmp), config()).start()
        try:
            lines = run(gw, args.prompts, args.sockets)
        finally:
            gw.stop()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
