"""`make screenshots`: PNGs of every console page from a real run, for docs/ui.md.

    python -m tests.browser.screenshots docs/ui

Starts `gpulane serve` in front of three fake upstreams, runs a small mixed
workload (bands, callers, models, so there are swaps, waits and overtakes),
then, while a long job holds the GPU and others wait, photographs each page
with the same headless Chromium the browser tests use.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

from tests.browser.conftest import chromium_path
from tests.e2e.gateway import Gateway, fake_model

MODELS = ("llama-8b", "qwen-coder", "sdxl")
# (model, caller, band, run seconds): a morning's mix, sent in bursts.
BURSTS = [
    [
        ("llama-8b", "alice", "interactive", 0.4),
        ("sdxl", "render-bot", "batch", 0.9),
        ("llama-8b", "bob", "normal", 0.5),
        ("qwen-coder", "carol", "normal", 0.4),
    ],
    [
        ("qwen-coder", "carol", "interactive", 0.3),
        ("sdxl", "render-bot", "batch", 0.8),
        ("llama-8b", "alice", "interactive", 0.3),
        ("llama-8b", "nightly", "batch", 0.6),
    ],
    [
        ("sdxl", "bob", "normal", 0.7),
        ("llama-8b", "alice", "interactive", 0.3),
        ("qwen-coder", "nightly", "batch", 0.5),
    ],
]
WAITING = [
    ("qwen-coder", "carol", "normal"),
    ("llama-8b", "nightly", "batch"),
    ("llama-8b", "alice", "interactive"),
    ("sdxl", "render-bot", "batch"),
    ("llama-8b", "bob", "normal"),
    ("qwen-coder", "dave", "interactive"),
]


FILM_SHOTS = 8


def post(gw: Gateway, model: str, caller: str, band: str, delay: float) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "fake": {"delay": delay},
    }
    headers = {"X-Gpulane-Caller": caller, "X-LlamaSwap-Priority": band}
    if caller == "render-bot":  # a film, shot by shot: one chain (docs/jobs.md, Chains)
        headers |= {"X-Gpulane-Chain": "film-1", "X-Gpulane-Chain-Length": str(FILM_SHOTS)}
    return httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ).status_code


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    path = chromium_path()
    if path is None:
        print("no chromium: run `make chromium`", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(16) as pool:
        config = "models:" + "".join(fake_model(m).replace("\n", "\n  ") for m in MODELS)
        gw = Gateway(Path(tmp), config + "\n").start()
        try:
            for burst in BURSTS:
                done = [pool.submit(post, gw, *job) for job in burst]
                for f in done:
                    f.result()
            busy = pool.submit(post, gw, "sdxl", "render-bot", "normal", 12.0)
            gw.wait_for("SELECT 1 FROM requests WHERE status = 'running'")
            waiting = [pool.submit(post, gw, m, c, b, 0.2) for m, c, b in WAITING]
            with sync_playwright() as p:
                args = ["--no-sandbox"] if os.geteuid() == 0 else []
                browser = p.chromium.launch(executable_path=path, args=args)
                page = browser.new_page(viewport={"width": 1400, "height": 800})
                page.goto(gw.url + "/ui/")
                expect(page.locator("#waiting-table tbody tr")).to_have_count(len(WAITING))
                page.screenshot(path=out / "queue.png", full_page=True)
                page.goto(gw.url + "/ui/models")
                expect(page.locator('tr[data-model="sdxl"] .state')).to_have_text("ready")
                page.screenshot(path=out / "models.png", full_page=True)
                page.goto(gw.url + "/ui/timeline")
                page.select_option("#window", "whole")
                page.click("form.controls button")
                expect(page.locator("rect.bar.req")).not_to_have_count(0)
                page.locator("rect.bar.req").nth(5).hover()
                page.screenshot(path=out / "timeline.png", full_page=True)
                longest = gw.sql(
                    "SELECT id FROM requests WHERE status = 'completed' "
                    "ORDER BY queue_wait_ms DESC LIMIT 1"
                )[0]["id"]
                page.goto(f"{gw.url}/ui/requests/{longest}")
                expect(page.locator("#story-status")).to_have_text("completed")
                page.screenshot(path=out / "story.png", full_page=True)
                page.goto(gw.url + "/ui/history")
                expect(page.locator("#history tbody tr")).not_to_have_count(0)
                page.screenshot(path=out / "history.png", full_page=True)
                page.goto(gw.url + "/ui/chains/film-1")
                expect(page.locator("#chain-eta")).to_contain_text("Expected to end at")
                page.screenshot(path=out / "chain.png", full_page=True)
                browser.close()
            busy.result()
            for f in waiting:
                f.result()
        finally:
            gw.stop()
    for name in ("queue", "timeline", "story", "models", "history", "chain"):
        print(out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/ui")))
