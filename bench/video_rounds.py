"""Rounds of videos, chats and deletes through gpulane's Videos API. Prints figures.

    python -m bench.video_rounds [--rounds 50] [--seed 1]

`gpulane serve` started as a user starts it, in front of
tools/fake_video_server.py (`kind: openai-videos`, renders of 0.4 s, polled
every 0.5 s) and a chat model (tools/fake_upstream.py), one model at a time.
Each round sends one or two videos (one in ten fails on its server), a chat
that needs the video server swapped out, and now and then deletes a video
(waiting or rendering). Then it counts, from the fake's record and the log:

- videos stopped mid-render (SIGTERM inside a render not deleted): 0;
- videos overlapping on the lane (a request_started before the previous end): 0;
- videos lost (without exactly one terminal event; completed without its
  content served through gpulane once the server was swapped out): 0;
- how much later than the server's end gpulane learnt it (the end's lag:
  the poll interval and the content fetch);
- `db check` and `replay --verify`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.render_rounds import TERMINAL, Summary, records, settled
from bench.render_rounds import _audit as audit_log
from tests.e2e.gateway import Gateway, fake_model


def config(record: Path) -> str:
    server = (
        "\n  sora-local:"
        "\n    kind: openai-videos"
        f"\n    cmd: {sys.executable} -m tools.fake_video_server --port ${{PORT}}"
        f" --render-s 0.4 --record {record}"
        "\n    checkEndpoint: /health"
        "\n    concurrencyLimit: 8"
        "\n    maxRunTime: 120"
    )
    return "models:" + server + fake_model("chat").replace("\n", "\n  ") + "\n"


def run_rounds(gw: Gateway, record: Path, rounds: int, seed: int = 1) -> tuple[Summary, list[str]]:
    rng = random.Random(seed)
    out = Summary(rounds=rounds)
    ids: dict[str, str] = {}
    """Prompt (each unique) -> gpulane's video id: the fake records its own ids."""
    t0 = time.monotonic()
    with gw.client(timeout=120) as client, cf.ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            sent = []
            for _ in range(rng.choice((1, 1, 2))):
                shot = f"shot {len(out.prompts) + len(sent)}"
                prompt = f"fail: {shot}" if rng.random() < 0.1 else shot
                r = client.post("/v1/videos", json={"prompt": prompt})
                assert r.status_code == 200, r.text
                sent.append(r.json()["id"])
                ids[prompt] = sent[-1]
            out.prompts += sent
            chat = pool.submit(
                client.post,
                "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            )
            if rng.random() < 0.2:
                victim = rng.choice(sent)
                time.sleep(rng.uniform(0.0, 0.4))
                client.delete(f"/v1/videos/{victim}")
                out.cancelled.add(victim)
            answer = chat.result(timeout=120)
            out.chats += 1
            if answer.status_code != 200:
                out.chat_failures.append(f"{answer.status_code} {answer.text[:100]}")
        settled(client)
        for video_id in out.prompts:
            if video_id in out.cancelled:
                continue
            video = client.get(f"/v1/videos/{video_id}").json()
            if video.get("status") == "completed":
                if client.get(f"/v1/videos/{video_id}/content").status_code != 200:
                    out.lost.append(f"{video_id}: completed without its content")
            elif video.get("status") != "failed":
                out.lost.append(f"{video_id}: {video.get('status')}")
    out.seconds = time.monotonic() - t0
    # The render rounds' audit reads `prompt_id`: gpulane's id, found by the prompt.
    shaped = record.with_suffix(".by_id.jsonl")
    lines = [r | {"prompt_id": ids.get(r.get("prompt") or "")} for r in records(record)]
    shaped.write_text("".join(json.dumps(r) + "\n" for r in lines))
    audit_log(gw, shaped, out)
    return out, lags(gw, shaped, out)


def lags(gw: Gateway, record: Path, out: Summary) -> list[str]:
    """The end's lag: from the server's end of a render to gpulane's terminal event."""
    ended = {r["prompt_id"]: r["at"] for r in records(record) if r["event"] == "render_ended"}
    marks = ",".join("?" * len(out.prompts))
    rows = gw.sql(
        f"SELECT request_id, type, data FROM events WHERE request_id IN ({marks})",
        *out.prompts,
    )
    found = []
    for row in rows:
        if row["type"] in TERMINAL[:2] and row["request_id"] in ended:
            at_ns = json.loads(row["data"])["at"]
            found.append(at_ns / 1e9 - ended[row["request_id"]])
    if not found:
        return ["end's lag: no ends"]
    found.sort()
    p90 = found[int(0.9 * (len(found) - 1))]
    return [
        f"end's lag (server's end -> gpulane's terminal event), {len(found)} videos: "
        f"median {statistics.median(found) * 1000:.0f} ms, p90 {p90 * 1000:.0f} ms, "
        f"max {found[-1] * 1000:.0f} ms"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.video_rounds", description=__doc__)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "videos.jsonl"
        gw = Gateway(Path(tmp), config(record)).start()
        try:
            summary, lag = run_rounds(gw, record, args.rounds, args.seed)
        finally:
            gw.stop()
    print("\n".join(line.replace("render", "video") for line in summary.lines()))
    print("\n".join(lag))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
