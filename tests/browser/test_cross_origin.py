"""A page on another origin calls gpulane with `apiKeys` set, in a real
browser (issue 28, item 3): the preflight passes without a key, the model list
is readable (its `Origin` echoed, as llama-swap), and a chat completion is
sent. As with llama-swap, reading a proxied answer from another origin is the
model server's CORS (llama-server sends `Access-Control-Allow-Origin`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.e2e.gateway import Gateway, fake_model

pytestmark = pytest.mark.browser

Start = Callable[[str], Gateway]
KEY = "sk-browser"


class _AppPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>app</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def app_origin() -> Iterator[str]:
    """A web app's own server: another port is another origin. A real server on
    loopback, as Chromium refuses a page from elsewhere calling a loopback API."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AppPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_another_origin_calls_the_api_with_a_key(
    gateway: Start, page: Page, app_origin: str
) -> None:
    gw = gateway(f"apiKeys: [{KEY}]\nmodels:" + fake_model("A").replace("\n", "\n  ") + "\n")
    page.goto(f"{app_origin}/")
    result: dict[str, Any] = page.evaluate(
        """async ([url, key]) => {
            const auth = {Authorization: `Bearer ${key}`};
            const models = await (await fetch(`${url}/v1/models`, {headers: auth})).json();
            let chat = "sent";
            try {
                await fetch(`${url}/v1/chat/completions`, {
                    method: "POST",
                    headers: {...auth, "Content-Type": "application/json"},
                    body: JSON.stringify({model: "A", messages: [{role: "user", content: "hi"}]}),
                });
            } catch (e) {
                chat = "unreadable";  // the fake upstream sends no CORS headers
            }
            return {ids: models.data.map((m) => m.id), chat};
        }""",
        [gw.url, KEY],
    )
    assert result["ids"] == ["A"]
    # The preflight let the browser send the completion, with its key: it ran.
    [row] = gw.wait_for("SELECT status FROM requests WHERE model='A' AND status='completed'")
    assert row["status"] == "completed"
