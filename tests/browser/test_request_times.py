"""The request page shows both the wait and the time to start (issue 39): a
request dispatched at once into its own 1.5 s load waited nothing, but a person
waited 1.5 s for it to start. Headless Chromium against `gpulane serve`."""

from __future__ import annotations

import concurrent.futures as cf
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.test_renders import comfy_config, workflow

pytestmark = pytest.mark.browser

CONFIG = "models:" + fake_model("A", "--start-delay 1.5").replace("\n", "\n  ") + "\n"


def test_the_request_page_shows_its_wait_and_its_time_to_start(
    gateway: Callable[[str], Gateway], page: Page
) -> None:
    gw = gateway(CONFIG)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        cold = client.post("/v1/chat/completions", json={"model": "A", "messages": []})
    assert cold.status_code == 200, cold.text
    # The story is read from the log, where the completion may still be on its way
    # (group commit); the page reads it once.
    rid = cold.headers["x-request-id"]
    assert gw.wait_for("SELECT 1 FROM requests WHERE id = ? AND status = 'completed'", rid)
    page.goto(f"{gw.url}/ui/requests/{cold.headers['x-request-id']}")
    expect(page.locator("#story-status")).to_have_text("completed")
    expect(page.locator("#story-waited")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#story-time-to-start")).to_have_text(
        re.compile(r"^\d+\.\d s \(its wait, then its own load\)$")
    )


def test_the_queue_page_says_a_run_past_every_run_of_its_model_has_no_known_end(
    gateway: Callable[[str], Gateway], page: Page, tmp_path: Path
) -> None:
    gw = gateway("models:" + fake_model("B").replace("\n", "\n  ") + "\n")
    hold = tmp_path / "release"
    chat = {"model": "B", "messages": []}
    with httpx.Client(base_url=gw.url, timeout=30) as client, cf.ThreadPoolExecutor(2) as pool:
        # B's history: one run of about 0.2 s; the next one runs until released.
        assert client.post("/v1/chat/completions", json={**chat, "fake": {"delay": 0.2}}).is_success
        held = pool.submit(
            client.post, "/v1/chat/completions", json={**chat, "fake": {"hold_file": str(hold)}}
        )
        # Only once the held run has started, or `behind` could run first and finish.
        poll(lambda: client.get("/api/queue").json()["running"], "the held run to start")
        behind = pool.submit(client.post, "/v1/chat/completions", json=chat)
        try:
            page.goto(gw.url + "/ui/")
            expect(page.locator("#running td.expected-end")).to_have_text(
                "unknown: longer than any run of its model"
            )
            expect(page.locator("#waiting-table td.start")).to_contain_text("at least")
        finally:
            hold.touch()
        assert held.result(timeout=30).status_code == 200
        assert behind.result(timeout=30).status_code == 200


def test_the_queue_page_shows_a_renders_progress_beside_its_expected_end(
    gateway: Callable[[str], Gateway], page: Page, tmp_path: Path
) -> None:
    gw = gateway(comfy_config(tmp_path / "renders.jsonl"))
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        body = {"prompt": workflow(6.0, steps=40)}
        assert client.post("/comfyui/prompt", json=body).status_code == 200
        page.goto(gw.url + "/ui/")
        end = page.locator("#running td.expected-end")
        expect(end).to_contain_text(re.compile(r"\(\d+/40 done\)"), timeout=15_000)
        expect(end).not_to_contain_text("unknown")
