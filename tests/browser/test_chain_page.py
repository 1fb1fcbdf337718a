"""The console's chain page (issue 29, item 2) in a real browser: a film sent shot
by shot (`X-Gpulane-Chain`) as one run, with the batch page's progress bar and
estimated finish, its shots linked to their stories, reached from Chains in the
navigation and from a shot's story."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, poll
from tests.e2e.test_chains import client, config, shot

pytestmark = pytest.mark.browser

Start = Callable[[str], Gateway]


def test_a_chain_page_shows_its_progress_its_eta_and_its_shots(
    gateway: Start, page: Page, tmp_path: Path
) -> None:
    gw = gateway(config())
    oa = client(gw, "none")
    first = [shot(oa, "film-7", 6, delay=0.3).headers["x-request-id"] for _ in range(2)]
    # The third shot runs until the page has been read (a fixed run could end
    # while a slow host loads it).
    release = tmp_path / "release-shot-3"
    sent: list[Any] = []
    producer = threading.Thread(
        target=lambda: sent.append(shot(oa, "film-7", 6, hold_file=str(release)))
    )
    producer.start()
    try:
        with gw.client() as http:
            poll(
                lambda: http.get("/api/chains/film-7").json()["progress"]["running"] == 1,
                "its third shot to run",
            )
            # Held, it soon runs longer than the first two (about 0.3 s each): its
            # end is then unknown, whenever the page reads it. (Its known end, in
            # the moment before, is a race with a slow host; see below.)
            poll(
                lambda: http.get("/api/chains/film-7").json()["progress"]["estimated_finish_open"],
                "its third shot to outrun the first two",
            )
        page.goto(f"{gw.url}/ui/chains/film-7")
        expect(page.locator("#chain-id")).to_have_text("film-7")
        expect(page.locator("#chain-status")).to_have_text("in_progress")
        expect(page.locator("#chain-progress")).to_have_attribute("max", "6")
        expect(page.locator("#chain-progress")).to_have_attribute("value", "2")
        expect(page.locator("#chain-summary")).to_contain_text(
            "2 done, 1 running, 3 waiting, 0 failed of 6"
        )
        expect(page.locator("#chain-eta")).to_contain_text(
            re.compile(r"^Expected to end after .* at the earliest .*its end unknown\.")
        )
        expect(page.locator("#chain-eta")).to_contain_text("later (a run has no known end)")
        expect(page.locator("main")).to_contain_text("3 shots not queued yet")
        rows = page.locator("#chain-shots tbody tr")
        expect(rows).to_have_count(3)
        expect(rows.nth(2)).to_contain_text("running")
        # A shot's story names the chain and its place, linked to the chain's page.
        rows.nth(1).locator("a").click()
        expect(page.locator("main")).to_contain_text("shot 2 of 6 of film-7")
        page.locator("#story-chain").click()
        expect(page.locator("#chain-id")).to_have_text("film-7")
    finally:
        release.touch()
        producer.join()
    # The answer can come before its completion is on disk, where the chain's
    # progress is read from (events are group-committed).
    with gw.client() as http:
        poll(
            lambda: http.get("/api/chains/film-7").json()["progress"]["done"] == 3,
            "the third shot's completion",
        )
    page.reload()
    expect(page.locator("#chain-summary")).to_contain_text("3 done, 0 running, 3 waiting")
    # Nothing runs: the end is known, three more shots of their median run; a
    # log of seconds gives an interval whose late end is not known yet, and why.
    expect(page.locator("#chain-eta")).to_contain_text("Expected to end at")
    expect(page.locator("#chain-eta")).to_contain_text("later (too little log to say)")
    # The bar is as wide as the page, as the batch page's.
    bar = page.locator("#chain-progress").bounding_box()
    main = page.locator("main").bounding_box()
    assert bar is not None and main is not None and bar["width"] >= 0.8 * main["width"]
    # The navigation reaches it: Chains lists it, linked to its page.
    page.goto(f"{gw.url}/ui/")
    page.get_by_role("link", name="Chains").click()
    expect(page).to_have_url(f"{gw.url}/ui/chains")
    expect(page.locator("#chains tbody tr")).to_have_count(1)
    expect(page.locator("#chains")).to_contain_text("3 / 6")
    page.get_by_role("link", name="film-7").click()
    expect(page.locator("#chain-id")).to_have_text("film-7")
    assert first  # both earlier shots answered
