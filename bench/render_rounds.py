"""Rounds of renders, chats and cancels on a fake ComfyUI. Prints figures.

    python -m bench.render_rounds [--rounds 50] [--seed 1] [--sleep]

`gpulane serve` started as a user starts it, in front of tools/fake_comfyui.py
(`comfyui_auto`, concurrencyLimit 50 as llama-swap sets it) and a chat model
(tools/fake_upstream.py), one model at a time. Each round sends one or two
renders (0.2 to 0.8 s), a chat that needs ComfyUI swapped out, and now and
then cancels a render (ComfyUI's `/interrupt` or `/queue {delete}`, or
gpulane's `DELETE /api/requests/ID`) or sends one that fails. Then it counts,
from the fake's record of its renders and from the log:

- renders stopped mid-render (SIGTERM inside a render not cancelled): 0;
- renders overlapping on the lane (a prompt's request_started before the
  previous one's end): 0;
- prompts lost (accepted, without exactly one terminal event or, unless
  cancelled, without a history entry served through gpulane): 0;
- `db check` and `replay --verify`.

With `--sleep`, ComfyUI has `sleep: comfyui`: each swap puts it to sleep by
`POST /free` and its next prompt wakes the same process. Then it also counts
renders that were running when a `/free` arrived (not cancelled ones: ComfyUI
finishes an interrupted prompt at its next step, and the sleep waits for its
queue to be idle): 0; and the sleeps, wakes and cold starts.

tests/e2e/test_render_rounds.py runs a few rounds of the same in the suite.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.gateway import REPO, Gateway, fake_model

TERMINAL = ("request_completed", "request_failed", "request_cancelled", "request_abandoned")


def config(record: Path, sleep: bool = False) -> str:
    comfy = (
        "\n  comfyui_auto:"
        f"\n    cmd: {sys.executable} -m tools.fake_comfyui --port ${{PORT}} --record {record}"
        "\n    checkEndpoint: /system_stats"
        "\n    concurrencyLimit: 50"
        "\n    maxRunTime: 120" + ("\n    sleep: comfyui" if sleep else "")
    )
    return "models:" + comfy + fake_model("chat").replace("\n", "\n  ") + "\n"


def workflow(seconds: float, fail: bool = False) -> dict[str, Any]:
    render = {"seconds": seconds, "steps": 8, "fail": fail}
    return {
        "1": {"class_type": "FakeRender", "inputs": render},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}},
    }


@dataclass
class Summary:
    rounds: int = 0
    prompts: list[str] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    chats: int = 0
    chat_failures: list[str] = field(default_factory=list)
    stopped_mid_render: list[str] = field(default_factory=list)
    freed_mid_render: list[str] = field(default_factory=list)
    freed_while_cancelled: int = 0
    """`/free`s that came while ComfyUI still finished a cancelled prompt."""
    swaps: dict[str, int] = field(default_factory=dict)
    """ComfyUI's `process_started`, `process_slept`, `process_woken` counts."""
    overlapping: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    terminal: dict[str, list[str]] = field(default_factory=dict)
    db_check: str = ""
    replay_verify: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.chat_failures
            or self.stopped_mid_render
            or self.freed_mid_render
            or self.overlapping
            or self.lost
        ) and (self.db_check.startswith("ok") and self.replay_verify.startswith("ok"))

    def lines(self) -> list[str]:
        ended = [t[0] for t in self.terminal.values() if len(t) == 1]
        return [
            f"rounds {self.rounds}: {len(self.prompts)} renders "
            f"({len(self.cancelled)} cancelled), {self.chats} chats, {self.seconds:.1f} s",
            f"renders stopped mid-render: {len(self.stopped_mid_render)} {self.stopped_mid_render}",
            f"renders under a /free: {len(self.freed_mid_render)} {self.freed_mid_render} "
            f"(and {self.freed_while_cancelled} while a cancelled one ended)",
            "ComfyUI: "
            + ", ".join(f"{k.removeprefix('process_')} {n}" for k, n in self.swaps.items()),
            f"renders overlapping on the lane: {len(self.overlapping)} {self.overlapping}",
            f"renders lost: {len(self.lost)} {self.lost}",
            "ends: " + ", ".join(f"{k} {ended.count(k)}" for k in TERMINAL if k in ended),
            f"chat failures: {len(self.chat_failures)} {self.chat_failures[:3]}",
            f"db check: {self.db_check}",
            f"replay --verify: {self.replay_verify}",
        ]


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def settled(client: httpx.Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = client.get("/api/queue").json()
        if not queue.get("running") and not queue.get("waiting"):
            return
        time.sleep(0.1)
    raise AssertionError("the queue never emptied")


def run_rounds(gw: Gateway, record: Path, rounds: int, seed: int = 1) -> Summary:
    rng = random.Random(seed)
    out = Summary(rounds=rounds)
    t0 = time.monotonic()
    with gw.client(timeout=120) as client, cf.ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            sent = []
            for _ in range(rng.choice((1, 1, 2))):
                fail = rng.random() < 0.1
                doc = {"prompt": workflow(rng.uniform(0.2, 0.8), fail)}
                r = client.post("/comfyui/prompt", json=doc)
                assert r.status_code == 200, r.text
                sent.append(r.json()["prompt_id"])
            out.prompts += sent
            chat = pool.submit(
                client.post,
                "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            )
            if rng.random() < 0.3:
                victim = rng.choice(sent)
                time.sleep(rng.uniform(0.0, 0.4))
                how = rng.choice(("interrupt", "queue", "delete"))
                if how == "interrupt":
                    client.post("/comfyui/interrupt", json={"prompt_id": victim})
                elif how == "queue":
                    client.post("/comfyui/queue", json={"delete": [victim]})
                else:
                    client.delete(f"/api/requests/{victim}")
                out.cancelled.add(victim)
            answer = chat.result(timeout=120)
            out.chats += 1
            if answer.status_code != 200:
                out.chat_failures.append(f"{answer.status_code} {answer.text[:100]}")
        settled(client)
        for prompt_id in out.prompts:
            entry = client.get(f"/comfyui/history/{prompt_id}").json().get(prompt_id)
            if entry is None:
                out.lost.append(f"{prompt_id}: no history entry")
    out.seconds = time.monotonic() - t0
    _audit(gw, record, out)
    return out


def _audit(gw: Gateway, record: Path, out: Summary) -> None:
    marks = ",".join("?" * len(out.prompts))
    rows = gw.sql(
        f"SELECT request_id, type FROM events WHERE request_id IN ({marks}) ORDER BY seq",
        *out.prompts,
    )
    running: str | None = None
    for row in rows:
        rid, kind = row["request_id"], row["type"]
        if kind == "request_started":
            if running is not None and running != rid:
                out.overlapping.append(f"{rid} started while {running} ran")
            running = rid
        elif kind in TERMINAL or kind == "request_requeued":
            if running == rid:
                running = None
            if kind in TERMINAL:
                out.terminal.setdefault(rid, []).append(kind)
    cancelled = {rid for rid, kinds in out.terminal.items() if "request_cancelled" in kinds}
    for rid in out.prompts:
        if len(out.terminal.get(rid, [])) != 1:
            out.lost.append(f"{rid}: terminal events {out.terminal.get(rid)}")
    out.cancelled |= cancelled
    out.stopped_mid_render = [
        r["prompt_id"]
        for r in records(record)
        if r["event"] == "stopped_mid_render" and r["prompt_id"] not in out.cancelled
    ]
    out.freed_mid_render = [
        r["rendering"]
        for r in records(record)
        if r["event"] == "free_requested"
        and r["rendering"] is not None
        and r["rendering"] not in out.cancelled
    ]
    out.freed_while_cancelled = sum(
        1
        for r in records(record)
        if r["event"] == "free_requested" and r["rendering"] in out.cancelled
    )
    for kind in ("process_started", "process_slept", "process_woken"):
        query = "SELECT count(*) AS n FROM events WHERE type = ? AND model = 'comfyui_auto'"
        out.swaps[kind] = int(gw.sql(query, kind)[0]["n"])
    check = gw.db_check()
    out.db_check = check.stdout.strip() if check.returncode == 0 else f"FAILED {check.stdout}"
    verify = subprocess.run(
        [sys.executable, "-m", "app.cli", "replay", str(gw.db), "--verify"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = verify.stdout.strip().splitlines()
    out.replay_verify = (text[0] if text else "") if verify.returncode == 0 else "FAILED"
    if verify.returncode == 0 and not out.replay_verify.startswith("ok"):
        out.replay_verify = "ok: " + out.replay_verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.render_rounds", description=__doc__)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sleep", action="store_true", help="ComfyUI with sleep: comfyui")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "renders.jsonl"
        gw = Gateway(Path(tmp), config(record, args.sleep)).start()
        try:
            summary = run_rounds(gw, record, args.rounds, args.seed)
        finally:
            gw.stop()
    print("\n".join(summary.lines()))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
