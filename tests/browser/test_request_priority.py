"""The request page says what became of a priority header that could not be
read (issue 32), as explain does: headless Chromium against `gpulane serve`."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model

pytestmark = pytest.mark.browser

CONFIG = "models:" + fake_model("A").replace("\n", "\n  ") + "\n"


def test_the_request_page_says_an_unreadable_priority_was_asked_and_0_used(
    gateway: Callable[[str], Gateway], page: Page
) -> None:
    gw = gateway(CONFIG)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        chat = {"model": "A", "messages": []}
        odd = client.post(
            "/v1/chat/completions", json=chat, headers={"X-LlamaSwap-Priority": "urgent"}
        )
        plain = client.post("/v1/chat/completions", json=chat)
    # The story is read from the log, where an answer's completion may still be on
    # its way (group commit); the page reads it once.
    ids = (odd.headers["x-request-id"], plain.headers["x-request-id"])
    assert gw.wait_for(
        "SELECT 1 FROM requests WHERE id IN (?, ?) AND status = 'completed'", *ids, count=2
    )
    page.goto(f"{gw.url}/ui/requests/{odd.headers['x-request-id']}")
    expect(page.locator("#story-unreadable")).to_have_text(" · asked 'urgent' (unreadable, used 0)")
    page.goto(f"{gw.url}/ui/requests/{plain.headers['x-request-id']}")
    expect(page.locator("#story-status")).to_have_text("completed")
    expect(page.locator("#story-unreadable")).to_have_count(0)
