"""The web console in a real browser (issue 14): headless Chromium against a real
`gpulane serve` in front of fake upstream processes. Each test checks what a
person sees and that what they did is in the event log."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.gateway import Gateway, fake_model

pytestmark = pytest.mark.browser

Start = Callable[[str], Gateway]
ADMIN_KEY = "sk-console-admin-5d1e"


def models(*names: str) -> str:
    return "models:" + "".join(fake_model(n).replace("\n", "\n  ") for n in names) + "\n"


@pytest.fixture
def send() -> Iterator[Callable[..., cf.Future[httpx.Response]]]:
    """send(gw, model, caller, priority, **fake): a chat request in the background."""
    pool = cf.ThreadPoolExecutor(max_workers=8)

    def submit(
        gw: Gateway, model: str, caller: str, priority: str = "normal", **fake: Any
    ) -> cf.Future[httpx.Response]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
        headers = {"X-Gpulane-Caller": caller, "X-LlamaSwap-Priority": priority}
        return pool.submit(
            httpx.post, gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        )

    yield submit
    pool.shutdown(wait=True, cancel_futures=True)


def waiting_callers(page: Page) -> Any:
    return page.locator("#waiting-table tbody tr td:nth-child(4)")


def request_id(gw: Gateway, caller: str) -> str:
    rows = gw.wait_for("SELECT id FROM requests WHERE caller = ?", caller)
    assert rows, f"no request from {caller}"
    return str(rows[0]["id"])


def test_queue_shows_requests_appear_reorder_and_leave(gateway: Start, page: Page, send) -> None:
    gw = gateway(models("A"))
    page.goto(gw.url + "/")  # / links to the console
    expect(page).to_have_url(gw.url + "/ui/")
    expect(page.locator("#running")).to_contain_text("The GPU is idle.")

    blocker = send(gw, "A", "blocker", hang=True)
    expect(page.locator("#running tbody tr")).to_contain_text("blocker")
    send(gw, "A", "b1", "batch", delay=0.2)
    expect(waiting_callers(page)).to_have_text(["b1"])
    send(gw, "A", "n1", "normal", delay=0.2)
    expect(waiting_callers(page)).to_have_text(["n1", "b1"])  # n1 overtakes b1
    send(gw, "A", "i1", "interactive", delay=0.2)
    expect(waiting_callers(page)).to_have_text(["i1", "n1", "b1"])

    # Each score term its own column (whatever terms the core has), and a reason per row.
    header = page.locator("#waiting-table thead")
    for term in ("priority", "affinity", "aging", "score", "reason"):
        expect(header).to_contain_text(term)
    rows = page.locator("#waiting-table tbody tr")
    expect(rows.nth(0).locator("td.reason")).to_contain_text("next: waits for the running job")
    expect(rows.nth(1).locator("td.reason")).to_contain_text(
        "behind a higher score (priority +100)"
    )
    expect(rows.nth(0).locator('td[data-term="priority"]')).to_have_text("100")
    expect(page.locator("#waiting-title")).to_have_text("Waiting (3)")

    # The run proceeds: the blocker is cut off, then the three leave in score order.
    with httpx.Client(base_url=gw.url) as client:
        client.delete(f"/api/requests/{request_id(gw, 'blocker')}").raise_for_status()
    expect(page.locator("#waiting")).to_contain_text("Nothing waits.", timeout=30_000)
    expect(page.locator("#running")).to_contain_text("The GPU is idle.", timeout=30_000)
    assert blocker.result().status_code == 409
    order = gw.wait_for(
        "SELECT r.caller FROM events e JOIN requests r ON r.id = e.request_id "
        "WHERE e.type = 'request_dispatched' ORDER BY e.seq",
        count=4,
    )
    assert [r["caller"] for r in order] == ["blocker", "i1", "n1", "b1"]


def test_timeline_of_a_copied_log_draws_each_request_and_opens_its_story(
    gateway: Start, page: Page, readonly_console, tmp_path: Path
) -> None:
    gw = gateway(models("A", "B"))
    ids = []
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for caller, model in (("c1", "A"), ("c2", "B"), ("c3", "A")):
            r = client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [], "fake": {"delay": 0.3}},
                headers={"X-Gpulane-Caller": caller},
            )
            r.raise_for_status()
            ids.append(r.headers["x-request-id"])
    gw.wait_for("SELECT 1 FROM events WHERE type = 'request_completed'", count=3)
    copy = tmp_path / "copied.db"
    assert gw.db_check().returncode == 0
    subprocess.run(
        [sys.executable, "-m", "app.cli", "db", "backup", str(copy), "--db", str(gw.db)],
        check=True,
    )
    gw.stop()  # the copy is all the console has
    console = readonly_console(copy)

    page.goto(console.url + "/ui/timeline")
    page.select_option("#window", "whole")
    page.click("form.controls button")
    bars = page.locator("rect.bar.req")
    expect(bars).to_have_count(3)
    expect(page.locator("rect.bar.swap")).to_have_count(3)  # A, then B, then A again
    for rid in ids:
        expect(page.locator(f'rect.bar.req[data-id="{rid}"]')).to_have_count(1)
    target = page.locator(f'rect.bar.req[data-id="{ids[1]}"]')
    target.hover()
    expect(page.locator("#hover")).to_contain_text(ids[1])
    target.click()
    expect(page).to_have_url(f"{console.url}/ui/requests/{ids[1]}")
    expect(page.locator("#story-id")).to_have_text(ids[1])
    expect(page.locator("#story-status")).to_have_text("completed")
    expect(page.locator("tr.event")).not_to_have_count(0)
    expect(page.locator("main")).to_contain_text("request_completed")
    expect(page.locator("main")).to_contain_text("A → B")  # the swap it caused


def test_cancel_and_unload_from_the_console_are_recorded(gateway: Start, page: Page, send) -> None:
    gw = gateway(models("A"))
    page.on("dialog", lambda dialog: dialog.accept())  # every confirmation: yes
    page.goto(gw.url + "/ui/")
    holder = send(gw, "A", "holder", hang=True)
    expect(page.locator("#running tbody tr")).to_contain_text("holder")
    victim = send(gw, "A", "victim", delay=0)
    expect(waiting_callers(page)).to_have_text(["victim"])
    page.locator("#waiting-table tbody tr", has_text="victim").get_by_role(
        "button", name="Cancel"
    ).click()
    expect(page.locator("#flash")).to_contain_text("it was queued")
    expect(page.locator("#waiting")).to_contain_text("Nothing waits.")
    page.locator("#running tbody tr", has_text="holder").get_by_role(
        "button", name="Cancel"
    ).click()
    expect(page.locator("#flash")).to_contain_text("it was running")
    expect(page.locator("#running")).to_contain_text("The GPU is idle.")
    cancelled = gw.wait_for(
        "SELECT r.caller, e.data FROM events e JOIN requests r ON r.id = e.request_id "
        "WHERE e.type = 'request_cancelled' ORDER BY e.seq",
        count=2,
    )
    assert [(r["caller"], json.loads(r["data"])["reason"]) for r in cancelled] == [
        ("victim", "explicit"),
        ("holder", "explicit"),
    ]
    assert victim.result().status_code >= 400 and holder.result().status_code >= 400

    page.goto(gw.url + "/ui/models")
    row = page.locator('tr[data-model="A"]')
    expect(row.locator(".state")).to_have_text("ready")
    row.get_by_role("button", name="Unload").click()
    expect(row.locator(".state")).to_have_text("stopped")
    stopped = gw.wait_for("SELECT data FROM events WHERE type = 'process_stopped'")
    assert json.loads(stopped[0]["data"])["reason"] == "unload"

    # Load goes through the scheduler like any request, and is recorded as one.
    row.get_by_role("button", name="Load", exact=True).click()
    expect(row.locator(".state")).to_have_text("ready")
    assert gw.wait_for("SELECT 1 FROM events WHERE type = 'swap_finished'", count=2)


def test_with_api_keys_the_console_asks_for_a_key_and_rejects_a_wrong_one(
    gateway: Start, page: Page
) -> None:
    gw = gateway(f"apiKeys:\n  - {ADMIN_KEY}\n" + models("A"))
    page.goto(gw.url + "/ui/")
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    page.fill("#key-input", "sk-wrong")
    page.click("#key-form button")
    expect(page.locator("#key-error")).to_contain_text("rejected")
    expect(dialog).to_be_visible()
    page.fill("#key-input", ADMIN_KEY)
    page.click("#key-form button")
    expect(dialog).to_be_hidden()
    expect(page.locator("#running")).to_contain_text("The GPU is idle.")
    assert ADMIN_KEY not in page.url
    assert page.evaluate("sessionStorage.getItem('gpulane.apiKey')") == ADMIN_KEY
    # The key is asked once per tab: another page of the console does not ask again.
    page.goto(gw.url + "/ui/history")
    expect(page.locator("#percentiles")).to_contain_text("No waits to chart")
    expect(dialog).to_be_hidden()
    # The data itself still needs the key; the page shell and assets hold none.
    assert httpx.get(gw.url + "/ui/api/queue").status_code == 401
    shell = httpx.get(gw.url + "/ui/history")
    assert shell.status_code == 200
    assert "script-src 'self'" in shell.headers["content-security-policy"]
    assert shell.headers["x-content-type-options"] == "nosniff"


PARALLEL = (
    "models:"
    + (fake_model("A") + "  concurrencyLimit: 2\n" + fake_model("C")).replace("\n", "\n  ")
    + """
routing:
  router:
    use: group
    settings:
      groups:
        gpu0: {swap: true, exclusive: false, members: [A]}
        gpu1: {swap: true, exclusive: false, members: [C]}
"""
)


def test_parallel_work_has_a_row_per_model_and_the_queue_says_what_each_waits_for(
    gateway: Start, page: Page, send
) -> None:
    """Two lanes and a two-slot model: three requests run at once, on two rows of
    the timeline (A's two overlapping ones stacked in its row), and the one left
    waiting says it waits for a free slot of A."""
    gw = gateway(PARALLEL)
    held = [send(gw, "A", "a1", hang=True), send(gw, "A", "a2", hang=True)]
    held.append(send(gw, "C", "c1", hang=True))
    page.goto(gw.url + "/ui/")
    expect(page.locator("#running tbody tr")).to_have_count(3)
    send(gw, "A", "w1", delay=0)
    expect(waiting_callers(page)).to_have_text(["w1"])
    expect(page.locator("#waiting-table thead")).to_contain_text("waits for")
    expect(page.locator("#waiting-table tbody tr td.waits-for")).to_have_text(["a free slot of A"])
    expect(page.locator("#waiting-table tbody tr td.reason")).to_have_text(
        ["next: waits for the running job"]  # A is in use beside C: no swap
    )

    # The timeline reads the log once: the three starts must be on disk first.
    started = "SELECT 1 FROM requests WHERE status = 'running' AND started_at IS NOT NULL"
    assert len(gw.wait_for(started, count=3)) == 3
    page.goto(gw.url + "/ui/timeline")
    a_row = page.locator('g.row[data-model="A"]')
    c_row = page.locator('g.row[data-model="C"]')
    expect(a_row.locator("rect.bar.req")).to_have_count(2)
    expect(c_row.locator("rect.bar.req")).to_have_count(1)
    expect(a_row.locator("text.row-label")).to_have_text("A")
    boxes = [a_row.locator("rect.bar.req").nth(i).bounding_box() for i in range(2)]
    c_box = c_row.locator("rect.bar.req").bounding_box()
    assert boxes[0] and boxes[1] and c_box
    # Stacked within A's row: overlapping in time, on distinct tracks.
    assert boxes[0]["y"] != boxes[1]["y"]
    assert boxes[0]["x"] < boxes[1]["x"] + boxes[1]["width"]
    assert boxes[1]["x"] < boxes[0]["x"] + boxes[0]["width"]
    assert c_box["y"] > max(b["y"] for b in boxes)  # C's own row, below A's
    expect(page.locator("#summary")).to_contain_text("2 models")

    with httpx.Client(base_url=gw.url) as client:
        for caller in ("a1", "a2", "c1"):
            client.delete(f"/api/requests/{request_id(gw, caller)}").raise_for_status()
    for future in held:
        assert future.result().status_code == 409


def test_a_new_users_queue_and_models_pages_read_well_at_1400_px(
    gateway: Start, page: Page, send
) -> None:
    # Issue 32: the reason squeezed to a word a line, field names as headers,
    # times with no zone, the models page without aliases, port or output, and
    # an unload of a busy model that said nothing of what it stops.
    entry = fake_model("A").replace(
        "checkEndpoint: /health", "checkEndpoint: /health\n  aliases: [alpha]"
    )
    gw = gateway("models:" + entry.replace("\n", "\n  ") + "\n")
    holder = send(gw, "A", "holder", hang=True)
    page.goto(gw.url + "/ui/")
    expect(page.locator("#running tbody tr")).to_contain_text("holder")
    send(gw, "A", "n1", "normal", delay=0)
    send(gw, "A", "b1", "batch", delay=0)
    expect(waiting_callers(page)).to_have_text(["n1", "b1"])
    header = page.locator("#waiting-table thead")
    expect(header).to_contain_text("fair share")
    expect(header).not_to_contain_text("fair_share")
    # No run of A has ended: its end is not known (issue 39), and the starts
    # behind it are the earliest they can be, in UTC.
    expect(page.locator("#running td.expected-end")).to_have_text(
        "unknown: longer than any run of its model"
    )
    expect(page.locator("#waiting-table td.start").nth(0)).to_contain_text("UTC")
    reason = page.locator("#waiting-table tbody tr").nth(1).locator("td.reason")
    expect(reason).to_contain_text("behind a higher score")
    box = reason.bounding_box()
    assert box is not None and box["width"] >= 200, box  # words on a line, not one each
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

    dialogs: list[str] = []

    def answer(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()  # no: the job keeps running

    page.on("dialog", answer)
    page.goto(gw.url + "/ui/models")
    row = page.locator('tr[data-model="A"]')
    expect(row).to_contain_text("alpha")
    expect(row).to_contain_text("port ")
    expect(page.locator('details[data-output="A"]')).to_contain_text("Recent output of A")
    busy = row.get_by_role("button", name="Unload (busy)…")
    busy.click()
    assert dialogs and "1 request is running on it" in dialogs[0], dialogs
    expect(row.locator(".state")).to_have_text("ready")  # dismissed: nothing stopped
    with httpx.Client(base_url=gw.url) as client:
        client.delete(f"/api/requests/{request_id(gw, 'holder')}").raise_for_status()
    assert holder.result().status_code == 409


def test_the_timeline_fits_a_fresh_servers_minutes(gateway: Start, page: Page) -> None:
    gw = gateway(models("A"))
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        client.post(
            "/v1/chat/completions", json={"model": "A", "messages": [], "fake": {"delay": 0.3}}
        ).raise_for_status()
    gw.wait_for("SELECT 1 FROM events WHERE type = 'request_completed'")
    page.goto(gw.url + "/ui/timeline")
    expect(page.locator("#window")).to_have_value("fit")
    bar = page.locator("rect.bar.req")
    expect(bar).to_have_count(1)
    # A minute-old log fills the chart, not 2% of an hour.
    width = float(bar.get_attribute("width") or 0)
    assert width > 1200 * 0.02, width
    expect(page.locator("#summary")).to_contain_text("UTC")
