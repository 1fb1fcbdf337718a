"""The request page shows both the wait and the time to start (issue 39): a
request dispatched at once into its own 1.5 s load waited nothing, but a person
waited 1.5 s for it to start. Headless Chromium against `gpulane serve`."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model

pytestmark = pytest.mark.browser

CONFIG = "models:" + fake_model("A", "--start-delay 1.5").replace("\n", "\n  ") + "\n"


def test_the_request_page_shows_its_wait_and_its_time_to_start(
    gateway: Callable[[str], Gateway], page: Page
) -> None:
    gw = gateway(CONFIG)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        cold = client.post("/v1/chat/completions", json={"model": "A", "messages": []})
    assert cold.status_code == 200, cold.text
    page.goto(f"{gw.url}/ui/requests/{cold.headers['x-request-id']}")
    expect(page.locator("#story-status")).to_have_text("completed")
    expect(page.locator("#story-waited")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#story-time-to-start")).to_have_text(
        re.compile(r"^\d+\.\d s \(its wait, then its own load\)$")
    )
