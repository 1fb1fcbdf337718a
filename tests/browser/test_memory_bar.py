"""The models page's GPU memory: under the memory router, without telemetry, a
bar over the budget holds each resident model's declared footprint, and each
model's row says its footprint (docs/ui.md)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model

pytestmark = pytest.mark.browser

Start = Callable[[str], Gateway]


def config() -> str:
    models = (fake_model("A") + fake_model("B")).replace("\n", "\n  ")
    models = models.replace(
        "checkEndpoint: /health", "checkEndpoint: /health\n    gpuMemory: 30GiB"
    )
    return (
        "models:"
        + models
        + "\nrouting:\n  router:\n    use: memory\n    settings:\n      memory: {budget: 80GiB}\n"
    )


def test_the_models_page_shows_the_memory_bar_and_each_footprint(
    gateway: Start, page: Page
) -> None:
    gw = gateway(config())
    for model in "AB":
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    page.goto(gw.url + "/ui/models")
    memory = page.locator("#memory")
    expect(memory).to_contain_text("memory router budget 80.0 GiB")
    expect(memory).to_contain_text("A 30.0 GiB (declared) · B 30.0 GiB (declared)")
    expect(memory.locator('rect[data-model="A"]')).to_have_count(1)
    expect(memory.locator('rect[data-model="B"]')).to_have_count(1)
    row = page.locator('tr[data-model="A"]')
    expect(row).to_contain_text("30.0 GiB (declared)")
