"""What another site's page makes a browser send changes nothing (issue 38,
item 2), against a real `gpulane serve`, with and without `apiKeys`: a foreign
`Origin` or `Sec-Fetch-Site: cross-site` on a route that changes state is 403
`cross_site_request`, a `Host` that is not this server's (DNS rebinding) is 403
`host_not_allowed`, a websocket from a foreign page does not open; curl-like
requests and the OpenAI client are unaffected (app/web/sites.py)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.e2e.gateway import (
    REPO,
    Gateway,
    fake_model,
    free_port,
    poll,
    raw_request,
    running_gateway,
)

KEY = "sk-admin-sites"
EVIL = "http://evil.example"
APP = "http://app.example:3000"  # listed in server.allowedOrigins
WS_MODEL = textwrap.dedent(
    f"""
      W:
        cmd: {sys.executable} -m tests.e2e.ws_upstream --port ${{PORT}}
        checkEndpoint: /health
    """
)
MODELS = "models:" + (fake_model("A") + WS_MODEL).replace("\n", "\n  ") + "\n"
BASIC = {"Authorization": "Basic " + base64.b64encode(f"user:{KEY}".encode()).decode()}


@pytest.fixture(scope="module")
def open_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """No apiKeys: the default `make run` config."""
    with running_gateway(Path(tmp_path_factory.mktemp("sites_open")), MODELS) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def keyed_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = (
        f"apiKeys: [{KEY}]\n"
        "server:\n"
        "  allowedHosts: [gpu.example.test, .lan.test]\n"
        f"  allowedOrigins: ['{APP}']\n" + MODELS
    )
    with running_gateway(Path(tmp_path_factory.mktemp("sites_keyed")), config) as gateway:
        yield gateway


def _refused(r: httpx.Response, code: str = "cross_site_request") -> str:
    assert r.status_code == 403, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == code and error["type"] == "permission_error", error
    return str(error["message"])


def _load(client: httpx.Client, model: str = "A") -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages})
    assert r.status_code == 200, r.text


def _loaded(client: httpx.Client) -> set[str]:
    return {row["model"] for row in client.get("/running").json()["running"]}


def test_get_unload_from_another_sites_page_is_refused_without_keys(open_gw: Gateway) -> None:
    with open_gw.client() as client:
        _load(client)
        message = _refused(client.get("/unload", headers={"Origin": EVIL}))
        assert "Origin http://evil.example" in message and "server.allowedOrigins" in message
        # Routing's spellings of the same path are the same route.
        _refused(client.get("/unload/", headers={"Origin": EVIL}))
        for path in (b"//unload", b"/unload//"):
            head = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: " + EVIL.encode()
            status, body = raw_request(open_gw, head + b"\r\n")
            assert status == 403 and b"cross_site_request" in body, (path, status, body)
        # An <img src=...> or a link: no Origin on a GET, but the browser says cross-site.
        for site in ("cross-site", "same-site"):
            message = _refused(client.get("/unload", headers={"Sec-Fetch-Site": site}))
            assert f"Sec-Fetch-Site: {site}" in message
        assert "A" in _loaded(client)  # nothing was unloaded
        # The address typed in the browser (none), the server's own page, and curl.
        assert client.get("/unload", headers={"Sec-Fetch-Site": "none"}).text == "OK"
        _load(client)
        own = {"Origin": open_gw.url, "Sec-Fetch-Site": "same-origin"}
        assert client.get("/unload", headers=own).text == "OK"
        _load(client)
        assert client.get("/unload").text == "OK"
        assert "A" not in _loaded(client)


def test_a_text_plain_post_from_another_site_is_refused_without_keys(open_gw: Gateway) -> None:
    """What a <form> or a no-cors fetch sends: no preflight, so only the server can refuse."""
    with open_gw.client() as client:
        _load(client)
        plain = {"Content-Type": "text/plain"}
        for headers in ({"Origin": EVIL}, {"Sec-Fetch-Site": "cross-site"}):
            r = client.post("/api/models/unload", content=b"x", headers=plain | headers)
            _refused(r)
            body = json.dumps({"model": "A", "messages": [{"role": "user", "content": "hi"}]})
            _refused(client.post("/v1/chat/completions", content=body, headers=plain | headers))
            _refused(client.delete("/v1/jobs/nothing", headers=headers))
            _refused(client.get("/upstream/A/health", headers=headers))
            _refused(client.get("/props?model=A", headers=headers))
        # The page's script may read why: the refusal carries CORS' allow-origin.
        r = client.post("/api/models/unload", headers={"Origin": EVIL})
        assert r.headers["access-control-allow-origin"] == "*"
        assert "A" in _loaded(client)
        # Reading is not changing: the model list and the queue answer any page.
        r = client.get("/v1/models", headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == EVIL
        r = client.get("/api/queue", headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200
        # A preflight is still llama-swap's: the request it announces is judged when it comes.
        r = client.options("/api/models/unload", headers={"Origin": EVIL})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        assert client.post("/api/models/unload").json() == {"msg": "ok"}


def test_keys_and_a_cached_basic_password_do_not_let_another_site_in(keyed_gw: Gateway) -> None:
    with keyed_gw.client(headers=BASIC) as client:
        _load(client)
        _refused(client.get("/unload", headers={"Origin": EVIL}))
        plain = {"Content-Type": "text/plain", "Origin": EVIL, "Sec-Fetch-Site": "cross-site"}
        _refused(client.post("/api/models/unload", content=b"x", headers=plain))
        _refused(client.get("/unload", headers={"Sec-Fetch-Site": "cross-site"}))
        assert "A" in _loaded(client)
        # Basic still reaches a model's own page, from this server's own pages.
        own = {"Origin": keyed_gw.url, "Sec-Fetch-Site": "same-origin"}
        assert client.get("/upstream/A/health", headers=own).status_code == 200
        # A listed origin may: the browser app the operator chose.
        listed = {"Origin": APP, "Sec-Fetch-Site": "cross-site"}
        assert client.post("/api/models/unload", headers=listed).json() == {"msg": "ok"}
        assert "A" not in _loaded(client)


def test_a_host_that_is_not_this_servers_is_refused(open_gw: Gateway, keyed_gw: Gateway) -> None:
    """DNS rebinding: evil.example resolves to 127.0.0.1, so the browser sends
    `Host: evil.example:PORT` and calls the page's own requests same-origin."""
    for gw, headers in ((open_gw, {}), (keyed_gw, {"Authorization": f"Bearer {KEY}"})):
        with gw.client(headers=headers) as client:
            rebound = f"evil.example:{gw.port}"
            same = {"Host": rebound, "Origin": f"http://{rebound}", "Sec-Fetch-Site": "same-origin"}
            message = _refused(client.get("/unload", headers=same), "host_not_allowed")
            assert "evil.example" in message and "server.allowedHosts" in message
            for path in ("/v1/models", "/api/queue", "/ui/"):
                _refused(client.get(path, headers={"Host": rebound}), "host_not_allowed")
            # What a load balancer probes stays open.
            assert client.get("/health", headers={"Host": rebound}).text == "OK"
            for host in (f"localhost:{gw.port}", f"127.0.0.1:{gw.port}", "[::1]", "a.localhost"):
                assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    with keyed_gw.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        for host in ("gpu.example.test", "GPU.example.test:8443", "box.lan.test", "lan.test"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        _refused(client.get("/v1/models", headers={"Host": "lan.test.evil"}), "host_not_allowed")


def _ws(gw: Gateway, path: str, headers: dict[str, str]) -> ClientConnection:
    url = gw.url.replace("http", "ws") + path
    return connect(url, additional_headers=headers, open_timeout=30)


def test_a_websocket_from_another_sites_page_does_not_open(
    open_gw: Gateway, keyed_gw: Gateway
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for gw, headers in ((open_gw, {}), (keyed_gw, auth)):
        for foreign in ({"Origin": EVIL}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            with pytest.raises(InvalidStatus) as refused:
                _ws(gw, "/upstream/W/ws", headers | foreign)
            response = refused.value.response
            assert response.status_code == 403, response
            error = json.loads(response.body or b"")["error"]
            assert error["code"] == "cross_site_request", error
            with pytest.raises(InvalidStatus) as refused:
                _ws(gw, "/props?model=W", headers | foreign)
            assert refused.value.response.status_code == 403
        # Nothing was queued for them.
        assert gw.sql("SELECT id FROM requests WHERE model='W'") == []
        # The server's own page, and a client that is no browser, open it.
        for own in ({"Origin": gw.url}, {}):
            with _ws(gw, "/upstream/W/ws", headers | own) as ws:
                json.loads(ws.recv(timeout=10))
                ws.send("hello")
                assert ws.recv(timeout=10) == "hello"
    with _ws(keyed_gw, "/upstream/W/ws", auth | {"Origin": APP}) as ws:
        assert json.loads(ws.recv(timeout=10))["path"] == "/ws"


def test_the_openai_client_is_unaffected(keyed_gw: Gateway) -> None:
    oa = openai.OpenAI(base_url=keyed_gw.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    answer = oa.chat.completions.create(model="A", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    assert [m.id for m in oa.models.list()] == ["A", "W"]


def test_the_read_only_console_refuses_a_rebinding_host(open_gw: Gateway, tmp_path: Path) -> None:
    """`gpulane ui --db` serves a copied log: a rebinding page must not read it."""
    with open_gw.client() as client:
        _load(client)
    open_gw.stop()  # a whole file, as one copied from a server
    try:
        port = free_port()
        command = [sys.executable, "-m", "app.cli", "ui", "--db", str(open_gw.db)]
        log = (tmp_path / "ui.log").open("wb")
        proc = subprocess.Popen(
            [*command, "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

                def info() -> httpx.Response | None:
                    assert proc.poll() is None, (tmp_path / "ui.log").read_text()
                    try:
                        return client.get("/ui/api/info")
                    except httpx.TransportError:
                        return None

                assert poll(info, "gpulane ui to answer", timeout=30).status_code == 200
                r = client.get("/ui/api/history", headers={"Host": f"evil.example:{port}"})
                _refused(r, "host_not_allowed")
                r = client.get("/ui/api/history", headers={"Host": f"localhost:{port}"})
                assert r.status_code == 200
        finally:
            proc.terminate()
            proc.wait(15)
            log.close()
    finally:
        open_gw.start()
