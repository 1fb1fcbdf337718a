"""A page on another origin calls gpulane, in a real browser (issue 28, item 3;
issue 38, item 2): the preflight passes without a key and the model list is
readable (its `Origin` echoed, as llama-swap), but what would change state
(a chat, an unload, a websocket) is refused unless the page's origin is in
`server.allowedOrigins`; then a chat completion is sent. As with llama-swap,
reading a proxied answer from another origin is the model server's CORS
(llama-server sends `Access-Control-Allow-Origin`).

The app's page is served on 127.0.0.1 (another port: the same site, so
Chromium sends `Sec-Fetch-Site: same-site`) or on localhost (another site:
`cross-site`); what Chromium sends is its own, not the test's."""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.e2e.gateway import Gateway, fake_model, poll

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


CHAT = """async ([url, key]) => {
    const auth = key ? {Authorization: `Bearer ${key}`} : {};
    const models = await (await fetch(`${url}/v1/models`, {headers: auth})).json();
    let chat;
    try {
        const r = await fetch(`${url}/v1/chat/completions`, {
            method: "POST",
            headers: {...auth, "Content-Type": "application/json"},
            body: JSON.stringify({model: "A", messages: [{role: "user", content: "hi"}]}),
        });
        chat = r.status === 403 ? (await r.json()).error.code : "sent";
    } catch (e) {
        chat = "sent";  // the fake upstream sends no CORS headers: unreadable, but it ran
    }
    return {ids: models.data.map((m) => m.id), chat};
}"""


def _keyed(extra: str = "") -> str:
    return f"apiKeys: [{KEY}]\n{extra}models:" + fake_model("A").replace("\n", "\n  ") + "\n"


def test_a_page_on_another_origin_reads_the_models_but_sends_no_chat(
    gateway: Start, page: Page, app_origin: str
) -> None:
    gw = gateway(_keyed())
    page.goto(f"{app_origin}/")
    result: dict[str, Any] = page.evaluate(CHAT, [gw.url, KEY])
    assert result == {"ids": ["A"], "chat": "cross_site_request"}
    assert gw.sql("SELECT id FROM requests") == []


def test_a_listed_origin_calls_the_api_with_a_key(
    gateway: Start, page: Page, app_origin: str
) -> None:
    gw = gateway(_keyed(f"server:\n  allowedOrigins: ['{app_origin}']\n"))
    page.goto(f"{app_origin}/")
    result: dict[str, Any] = page.evaluate(CHAT, [gw.url, KEY])
    assert result["ids"] == ["A"] and result["chat"] == "sent"
    # The preflight let the browser send the completion, with its key: it ran.
    [row] = gw.wait_for("SELECT status FROM requests WHERE model='A' AND status='completed'")
    assert row["status"] == "completed"


WS_MODEL = textwrap.dedent(
    f"""
      W:
        cmd: {sys.executable} -m tests.e2e.ws_upstream --port ${{PORT}}
        checkEndpoint: /health
    """
)

UNLOAD_AND_SOCKET = """async (url) => {
    // What any page can send without a preflight: a GET with no-cors, a form's
    // text/plain POST; and a websocket, which has no CORS at all.
    // Chromium may fail such a fetch once sent (an opaque JSON answer is
    // blocked): what counts is whether the server acted on it.
    await fetch(`${url}/unload`, {mode: "no-cors"}).catch(() => null);
    await fetch(`${url}/api/models/unload`, {
        method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: "x",
    }).catch(() => null);
    const socket = await new Promise((resolve) => {
        const ws = new WebSocket(`${url.replace("http", "ws")}/upstream/W/ws`);
        ws.onmessage = () => { ws.close(); resolve("opened"); };
        ws.onerror = () => resolve("refused");
    });
    return socket;
}"""


def test_another_sites_page_cannot_unload_or_open_a_socket_without_keys(
    gateway: Start, page: Page, app_origin: str
) -> None:
    """No apiKeys, as `make run`: any page the operator visits could, before."""
    models = "models:" + (fake_model("A") + WS_MODEL).replace("\n", "\n  ") + "\n"
    gw = gateway(models)
    with gw.client() as client:
        messages = [{"role": "user", "content": "hi"}]
        r = client.post("/v1/chat/completions", json={"model": "A", "messages": messages})
        assert r.status_code == 200
    port = app_origin.rsplit(":", 1)[1]
    # Another port of 127.0.0.1 (same-site), and localhost (cross-site).
    for origin in (app_origin, f"http://localhost:{port}"):
        page.goto(f"{origin}/")
        assert page.evaluate(UNLOAD_AND_SOCKET, gw.url) == "refused", origin
    with gw.client() as client:
        assert "A" in {row["model"] for row in client.get("/running").json()["running"]}
    assert gw.sql("SELECT id FROM requests WHERE model='W'") == []
    # The server's own page opens the socket, and may unload.
    page.goto(f"{gw.url}/ui/")
    assert page.evaluate(UNLOAD_AND_SOCKET, gw.url) == "opened"
    with gw.client() as client:
        poll(
            lambda: "A" not in {row["model"] for row in client.get("/running").json()["running"]},
            "the console's own unload to stop A",
        )
