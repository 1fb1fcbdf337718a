"""The timeline's GPU memory: on a fake GPU shared by files, each load says the
footprint its model held (`gpu_memory_mib` from the log), the row's label its
largest, and the models page's memory bar stands above the chart (docs/ui.md)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model, poll

pytestmark = pytest.mark.browser


def test_the_timeline_shows_each_models_footprint_and_the_memory_bar(
    tmp_path: Path, page: Page
) -> None:
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    models = (
        fake_model("A", f"--gpu-dir {gpu} --gpu-mib 30720")
        + fake_model("B", f"--gpu-dir {gpu} --gpu-mib 10240")
    ).replace("\n", "\n  ")
    gw = Gateway(tmp_path, "models:" + models + "\n")
    gw.env = {"GPULANE_FAKE_GPU": f"{gpu}:81920"}
    gw.start()
    try:
        for model in "AB":
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
        # The answer can reach us before its events are committed (group commit).
        poll(
            lambda: len(gw.sql("SELECT 1 FROM events WHERE type = 'swap_finished'")) == 2 or None,
            "both loads recorded",
        )
        page.goto(gw.url + "/ui/timeline")
        row = page.locator('g.row[data-model="A"]')
        expect(row.locator("rect.swap")).to_have_attribute("data-mib", "30720")
        expect(row.locator("rect.swap title")).to_have_text("load A, holds 30.0 GiB")
        expect(row.locator("text.row-memory")).to_contain_text("30.0 GiB")
        expect(page.locator('g.row[data-model="B"] text.row-memory')).to_contain_text("10.0 GiB")
        page.locator('g.row[data-model="B"] rect.swap').hover()
        expect(page.locator("#hover")).to_contain_text("holds 10.0 GiB")
        memory = page.locator("#timeline-memory #memory")
        expect(memory).to_contain_text("GPU memory: 10.0 GiB of 80.0 GiB used")
        expect(memory.locator('rect[data-model="B"]')).to_have_count(1)
    finally:
        gw.stop()
