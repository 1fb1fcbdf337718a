"""llama-swap's routes and shapes (issue 24, item 3), against a real `gpulane serve`
and fake upstreams that echo the path and body they received: every route
llama-swap dispatches by model with its path rewriting, `/v1/models` and
`/models`, `/running`, the log streams, ids with slashes, `setParamsByID`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.web.model_routes import FORM_ROUTES, GET_ROUTES, JSON_ROUTES, forwarded_path
from tests.e2e.gateway import Gateway, fake_model, running_gateway

# The fake upstream answers these itself instead of echoing what it received.
# The fake upstream answers these in their own shapes; every other path is echoed.
_ANSWERED = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}


def _model(model_id: str, **keys: Any) -> str:
    entry = fake_model(model_id)
    for key, value in keys.items():
        entry += f"  {key}: {json.dumps(value)}\n"
    return entry.replace("\n", "\n  ")


CONFIG = (
    "includeAliasesInList: true\nmodels:"
    + _model(
        "A",
        aliases=["alpha"],
        name="Model A",
        description="the first",
        metadata={"family": "fake", "port": 1},
        filters={
            "setParams": {"top_k": 5},
            "setParamsByID": {"A:think": {"temperature": 0.1, "top_k": 9, "model": "x"}},
        },
    )
    + _model("org/model")
    + _model("org/model/v2")
    + _model("hidden", unlisted=True)
    + "\n"
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(Path(tmp_path_factory.mktemp("llama_swap")), CONFIG) as gateway:
        yield gateway


@pytest.fixture
def client(gw: Gateway) -> Iterator[httpx.Client]:
    with gw.client() as c:
        yield c


def _error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


# -- model-dispatched routes ----------------------------------------------------------


def test_every_json_route_reaches_the_upstream_at_llama_swaps_path(
    gw: Gateway, client: httpx.Client
) -> None:
    for path in JSON_ROUTES:
        r = client.post(path, json={"model": "A", "input": "x"})
        assert r.status_code == 200, (path, r.text)
        assert r.headers["x-request-id"] and r.headers["x-gpulane-band"] == "normal"
        if path not in _ANSWERED:
            assert r.json()["path"] == forwarded_path(path), path
        assert r.json()["served_by"] == "A"
    assert forwarded_path("/v/chat/completions") == "/chat/completions"
    assert forwarded_path("/audioapi/v1/tasks/run") == "/v1/tasks/run"
    assert forwarded_path("/sdapi/v1/txt2img") == "/sdapi/v1/txt2img"
    # Queued, scored and logged like any request: one row each, by the path asked.
    rows = gw.wait_for(
        "SELECT endpoint FROM requests WHERE status='completed'", count=len(JSON_ROUTES)
    )
    assert set(JSON_ROUTES) <= {row["endpoint"] for row in rows}


def test_get_routes_take_the_model_from_the_query_string(client: httpx.Client) -> None:
    for path in GET_ROUTES:
        r = client.get(path, params={"model": "alpha", "x": "1"})
        assert r.status_code == 200, (path, r.text)
        echo = r.json()
        assert echo["method"] == "GET" and echo["served_by"] == "A"
        assert echo["path"] == f"{path}?model=alpha&x=1"
    _error(client.get("/props"), 400, "missing_model")
    _error(client.get("/props", params={"model": "nope"}), 404, "model_not_found")
    # /v1/audio/voices is both: a JSON POST as well.
    r = client.post("/v1/audio/voices", json={"model": "A"})
    assert r.status_code == 200 and r.json()["method"] == "POST"


def test_a_wrong_method_is_405_naming_the_allowed_ones(client: httpx.Client) -> None:
    r = client.get("/v1/messages/count_tokens")
    _error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    r = client.put("/v1/audio/voices", json={"model": "A"})
    _error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET, POST"
    r = client.post("/props", json={"model": "A"})
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    assert set(FORM_ROUTES) == {"/v1/audio/transcriptions", "/v1/images/edits"}


def test_set_params_by_id_resolves_a_variant_id_and_sets_its_params(
    client: httpx.Client,
) -> None:
    r = client.post("/v1/messages/count_tokens", json={"model": "A:think", "top_k": 1})
    assert r.status_code == 200, r.text
    sent = json.loads(r.json()["body"])
    # setParams, then the variant's params (which win); `model` is never set.
    assert sent == {"model": "A:think", "top_k": 9, "temperature": 0.1}
    assert r.json()["served_by"] == "A"
    sent = json.loads(client.post("/v1/rerank", json={"model": "A"}).json()["body"])
    assert sent == {"model": "A", "top_k": 5}
    sent = json.loads(client.post("/v1/rerank", json={"model": "alpha"}).json()["body"])
    assert sent == {"model": "alpha", "top_k": 5}


# -- /v1/models, /models, /running ---------------------------------------------------


def test_models_list_has_llama_swaps_fields_and_gpulanes(client: httpx.Client) -> None:
    assert client.post("/v1/rerank", json={"model": "A"}).status_code == 200
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    same = client.get("/models").json()["data"]
    assert [m | {"created": 0} for m in same] == [m | {"created": 0} for m in listing["data"]]
    by_id = {m["id"]: m for m in listing["data"]}
    # Sorted by id; unlisted hidden; with includeAliasesInList, aliases too.
    assert [m["id"] for m in listing["data"]] == sorted(by_id)
    assert list(by_id) == ["A", "A:think", "alpha", "org/model", "org/model/v2"]
    a = by_id["A"]
    assert a["object"] == "model" and a["owned_by"] == "gpulane" and a["created"] > 0
    assert (a["name"], a["description"]) == ("Model A", "the first")
    assert a["status"] == {"value": "loaded"} and a["state"] == "ready"
    assert a["meta"] == {
        "llamaswap": {"family": "fake", "port": 1, "type": "model", "aliases": ["alpha", "A:think"]}
    }
    alias = by_id["alpha"]
    assert alias["meta"]["llamaswap"] == {
        "family": "fake",
        "port": 1,
        "type": "alias",
        "modelID": "A",
    }
    assert alias["status"] == {"value": "loaded"} and alias["name"] == "Model A"
    other = by_id["org/model"]
    assert other["status"] == {"value": "unloaded"} and other["state"] == "stopped"
    assert other["meta"] == {"llamaswap": {"type": "model"}}
    assert "name" not in other and "description" not in other


def test_the_openai_client_lists_the_models(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    ids = [m.id for m in client.models.list()]
    assert ids == ["A", "A:think", "alpha", "org/model", "org/model/v2"]


def test_running_has_llama_swaps_fields_and_gpulanes(client: httpx.Client) -> None:
    assert client.post("/v1/rerank", json={"model": "A"}).status_code == 200
    [row] = client.get("/running").json()["running"]
    assert set(row) == {
        "model",
        "state",
        "cmd",
        "proxy",
        "ttl",
        "name",
        "description",
        "pid",
        "in_flight",
    }
    assert (row["model"], row["state"], row["name"], row["description"]) == (
        "A",
        "ready",
        "Model A",
        "the first",
    )
    assert "tools.fake_upstream" in row["cmd"] and row["proxy"].startswith("http://")


# -- ids with slashes ---------------------------------------------------------------


def test_an_id_with_slashes_works_wherever_an_id_is_a_path(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "org/model", "messages": []})
    assert r.status_code == 200 and r.json()["served_by"] == "org/model"
    for url in ("/upstream/org/model/some/page?q=1", "/upstream/org%2Fmodel/some/page?q=1"):
        r = client.get(url)
        assert r.status_code == 200, (url, r.text)
        assert (r.json()["served_by"], r.json()["path"]) == ("org/model", "/some/page?q=1")
    # The longest configured id wins.
    r = client.post("/upstream/org/model/v2/x%2Fy", json={"a": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["served_by"], r.json()["path"]) == ("org/model/v2", "/x%2Fy")
    _error(client.get("/upstream/org/nothing/x"), 404, "model_not_found")
    for url in ("/api/models/unload/org/model/v2", "/api/models/unload/org%2Fmodel%2Fv2"):
        r = client.post(url)
        assert (r.status_code, r.text) == (200, "OK"), url
    _error(client.post("/api/models/unload/org/nothing"), 404, "model_not_found")


# -- log streams --------------------------------------------------------------------


def _read_until(client: httpx.Client, url: str, needle: str, limit: int = 5000) -> list[str]:
    """Lines of a log stream, up to the first holding `needle` (or `limit` lines)."""
    seen: list[str] = []
    with client.stream("GET", url, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        for line in r.iter_lines():
            seen.append(line)
            if needle in line or len(seen) >= limit:
                break
    return seen


def test_log_streams_replay_what_they_hold_first(client: httpx.Client) -> None:
    # Lines from before the stream opened arrive first, as llama-swap sends them.
    assert client.post("/v1/rerank", json={"model": "A"}).status_code == 200
    assert client.post("/v1/rerank", json={"model": "org/model"}).status_code == 200
    seen = _read_until(client, "/logs/stream", "org/model handled POST /v1/rerank")
    assert "[upstream:A] A handled POST /v1/rerank" in seen
    assert seen[-1] == "[upstream:org/model] org/model handled POST /v1/rerank"
    # One source: its lines' text alone.
    seen = _read_until(client, "/logs/stream/org/model", "handled POST /v1/rerank")
    assert seen[-1] == "org/model handled POST /v1/rerank"
    assert not any("A handled" in line for line in seen)
    seen = _read_until(client, "/logs/stream/alpha", "A handled POST /v1/rerank")
    assert seen[-1] == "A handled POST /v1/rerank"
    seen = _read_until(client, "/logs/stream/upstream", "org/model handled POST")
    assert "A handled POST /v1/rerank" in seen
    text = client.get("/logs").text
    proxy_lines = [line for line in text.splitlines() if line.startswith("[proxy] ")]
    if proxy_lines:
        wanted = proxy_lines[-1].removeprefix("[proxy] ")
        assert _read_until(client, "/logs/stream/proxy", wanted)[-1] == wanted
    _error(client.get("/logs/stream/nope"), 404, "not_found")


def test_no_history_sends_only_new_lines(gw: Gateway, client: httpx.Client) -> None:
    assert client.post("/v1/rerank", json={"model": "A"}).status_code == 200
    with (
        gw.client(timeout=30) as streamer,
        streamer.stream("GET", "/logs/stream/A?no-history") as r,
    ):
        assert r.status_code == 200
        assert client.post("/v1/embeddings", json={"model": "A", "input": "x"}).status_code == 200
        first = next(r.iter_lines())
    assert first == "A handled POST /v1/embeddings"
