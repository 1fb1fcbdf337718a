"""Websockets through a real `gpulane serve` to a real websocket server
(tests/e2e/ws_upstream.py), on the routes llama-swap passes them on:
`/upstream/MODEL/...` and the model-dispatched GET routes (issue 28, item 5)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.e2e.gateway import Gateway, poll, running_gateway

KEY = "sk-admin-ws"
USER_KEY = "sk-user-ws"
AUTH = {"Authorization": f"Bearer {KEY}"}

CONFIG = textwrap.dedent(
    f"""
    apiKeys:
      - {KEY}
      - key: {USER_KEY}
        label: someone
        role: user
    models:
      W:
        cmd: {sys.executable} -m tests.e2e.ws_upstream --port ${{PORT}}
        checkEndpoint: /health
        aliases: [realtime]
      I:
        cmd: {sys.executable} -m tests.e2e.ws_upstream --port ${{PORT}}
        checkEndpoint: /health
        compat:
          ignoreWebsockets: true
    """
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(Path(tmp_path_factory.mktemp("websockets")), CONFIG) as gateway:
        yield gateway


def _open(gw: Gateway, path: str, **kw: object) -> ClientConnection:
    kw.setdefault("additional_headers", kw.pop("headers", AUTH))
    kw.setdefault("open_timeout", 30)
    return connect(gw.url.replace("http", "ws") + path, **kw)  # type: ignore[arg-type]


def _in_flight(gw: Gateway, model: str = "W") -> int:
    with gw.client(headers=AUTH) as client:
        rows = client.get("/running").json()["running"]
    return sum(row["in_flight"] for row in rows if row["model"] == model)


def test_an_echo_through_upstream_loads_the_model_and_holds_a_slot(gw: Gateway) -> None:
    with _open(gw, "/upstream/W/ws?x=1", subprotocols=["chat"]) as ws:  # type: ignore[list-item]
        hello = json.loads(ws.recv(timeout=10))
        # The path and query as the client sent them, less /upstream/W.
        assert hello["path"] == "/ws?x=1"
        assert hello["subprotocol"] == "chat" and ws.subprotocol == "chat"
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        ws.send(b"\x00\x01binary")
        assert ws.recv(timeout=10) == b"\x00\x01binary"
        assert ws.response is not None and ws.response.headers["x-request-id"]
        request_id = ws.response.headers["x-request-id"]
        # An open socket is a running request on its model.
        assert _in_flight(gw) == 1
    [row] = gw.wait_for(
        "SELECT endpoint, status, http_status FROM requests WHERE id=? AND status='completed'",
        request_id,
    )
    assert (row["endpoint"], row["http_status"]) == ("/upstream/ws", 101)
    deadline = time.monotonic() + 10
    while _in_flight(gw) != 0:
        assert time.monotonic() < deadline, "the socket's slot was not freed"
        time.sleep(0.05)


def test_the_upstreams_close_code_reaches_the_client(gw: Gateway) -> None:
    with _open(gw, "/upstream/realtime/v1/realtime") as ws:
        assert json.loads(ws.recv(timeout=10))["path"] == "/v1/realtime"
        ws.send("close 4001")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001


def test_a_clients_header_reaches_the_upstream(gw: Gateway) -> None:
    headers = AUTH | {"X-Test": "through the proxy"}
    with _open(gw, "/upstream/W/ws?header=1", headers=headers) as ws:
        hello = json.loads(ws.recv(timeout=10))
    assert hello["path"] == "/ws?header=1" and hello["x-test"] == "through the proxy"


def test_the_clients_close_code_reaches_the_upstream(gw: Gateway) -> None:
    with _open(gw, "/upstream/W/ws?close=4002") as ws:
        ws.recv(timeout=10)  # the hello: the upstream's socket is open
        ws.close(4002, "done here")
    with gw.client(headers=AUTH) as client:
        closed = poll(
            lambda: client.get("/upstream/W/closed").json().get("/ws?close=4002"),
            "the upstream to see the client's close",
        )
    assert closed == {"code": 4002, "reason": "done here"}


def test_a_model_dispatched_get_route_takes_a_socket(gw: Gateway) -> None:
    with _open(gw, "/props?model=W") as ws:
        assert json.loads(ws.recv(timeout=10))["path"] == "/props?model=W"


def test_refusals_are_http_answers(gw: Gateway) -> None:
    for path, headers, status in (
        ("/upstream/W/ws", {}, 401),  # no key: refused by the key middleware
        ("/upstream/W/ws", {"Authorization": f"Bearer {USER_KEY}"}, 403),  # admin only
        ("/upstream/nothing/ws", AUTH, 404),
        ("/props", AUTH, 400),  # no ?model=
        ("/upstream/W/refuse", AUTH, 403),  # the upstream's own answer
    ):
        with pytest.raises(InvalidStatus) as refused:
            _open(gw, path, headers=headers)
        response = refused.value.response
        assert response.status_code == status, (path, response)
        if status == 401:  # the key middleware's answer, as for HTTP
            assert "Basic realm" in response.headers["www-authenticate"]
            assert json.loads(response.body or b"")["error"]["code"] == "invalid_api_key"
        if path == "/upstream/nothing/ws":  # gpulane's error shape, naming the model
            error = json.loads(response.body or b"")["error"]
            assert error["code"] == "model_not_found" and "'nothing'" in error["message"]
    # An HTTP request on the same route is still HTTP.
    with httpx.Client(base_url=gw.url, headers=AUTH) as client:
        assert client.get("/upstream/W/health").text == "OK\n"


def test_an_operators_cancel_closes_an_open_socket(gw: Gateway) -> None:
    with _open(gw, "/upstream/W/ws") as ws:
        ws.recv(timeout=10)  # the hello
        assert ws.response is not None
        request_id = ws.response.headers["x-request-id"]
        with httpx.Client(base_url=gw.url, headers=AUTH) as client:
            assert client.delete(f"/api/requests/{request_id}").status_code == 200
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    [row] = gw.wait_for("SELECT status FROM requests WHERE id=? AND status='cancelled'", request_id)
    assert _in_flight(gw) == 0


def test_a_socket_whose_client_leaves_while_queued_is_cancelled(gw: Gateway) -> None:
    with _open(gw, "/upstream/W/ws") as first:
        first.recv(timeout=10)  # it holds W's one slot
        # The second waits for that slot; its client gives up before it opens.
        with pytest.raises(TimeoutError):
            _open(gw, "/upstream/W/ws", open_timeout=1)
        [row] = gw.wait_for(
            "SELECT endpoint FROM requests WHERE status='cancelled' AND model='W'"
            " AND id NOT IN (SELECT request_id FROM events WHERE type='request_started')"
        )
        assert row["endpoint"] == "/upstream/ws"
        first.send("still here")
        assert first.recv(timeout=10) == "still here"


def test_an_ignored_websocket_cannot_load_its_model_and_holds_no_slot(gw: Gateway) -> None:
    # compat.ignoreWebsockets, as llama-swap: a socket for a model that is not
    # loaded gets 409 and loads nothing.
    with gw.client(headers=AUTH) as client:
        client.get("/upstream/W/health")  # W is the one resident model, I is not
        with pytest.raises(InvalidStatus) as refused:
            _open(gw, "/upstream/I/ws")
        response = refused.value.response
        assert response.status_code == 409
        error = json.loads(response.body or b"")["error"]
        assert error["code"] == "model_not_loaded" and "'I'" in error["message"]
        assert "I" not in {row["model"] for row in client.get("/running").json()["running"]}
        # Once loaded, it bypasses the scheduler: no request, no slot.
        assert client.get("/upstream/I/health").status_code == 200
    with _open(gw, "/upstream/I/ws") as ws:
        assert json.loads(ws.recv(timeout=10))["path"] == "/ws"
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        assert ws.response is not None and "x-request-id" not in ws.response.headers
        assert _in_flight(gw, "I") == 0
        # Its model's one slot is free for an ordinary request meanwhile.
        with httpx.Client(base_url=gw.url, headers=AUTH) as client:
            assert client.get("/upstream/I/health").status_code == 200


def test_a_refused_upgrade_is_recorded_with_its_id(gw: Gateway) -> None:
    """Refused for its model or a header (not for its key): a `request_rejected`,
    whose id the refusal carries, as every door's refusals do (test_refusals.py)."""
    # Refused for its key: answered before the door, not recorded.
    with pytest.raises(InvalidStatus):
        _open(gw, "/upstream/W/ws", headers={"Authorization": f"Bearer {USER_KEY}"})
    for path, headers, status, said in (
        ("/upstream/nothing/ws", AUTH, 404, "model 'nothing' is not configured"),
        ("/upstream/W/ws", AUTH | {"X-Gpulane-Max-Wait": "soon"}, 400, "X-Gpulane-Max-Wait"),
    ):
        with pytest.raises(InvalidStatus) as refused:
            _open(gw, path, headers=headers)
        response = refused.value.response
        assert response.status_code == status
        request_id = response.headers.get("x-request-id")
        assert request_id, (path, dict(response.headers))
        rows = gw.wait_for(
            "SELECT data FROM events WHERE type = 'request_rejected' AND request_id = ?",
            request_id,
        )
        assert len(rows) == 1, path
        event = json.loads(rows[0]["data"])
        assert event["http_status"] == status and said in event["error"]
        assert event["endpoint"] == "/upstream/ws"
    # The log commits in order: the key's refusal would be on disk by now.
    keys = gw.sql(
        "SELECT count(*) FROM events WHERE type = 'request_rejected' "
        "AND json_extract(data, '$.http_status') IN (401, 403)"
    )
    assert keys[0][0] == 0
