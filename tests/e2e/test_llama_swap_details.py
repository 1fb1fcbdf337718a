"""llama-swap's smaller differences (issue 28, item 7) against a real `gpulane
serve`: `src` on gpulane's own errors, `capabilities` in `/v1/models`, and the
stopping rows of `/running`."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, running_gateway

KEY = "sk-admin-details"
AUTH = {"Authorization": f"Bearer {KEY}"}

CONFIG = (
    f"apiKeys: [{KEY}]\nmodels:"
    + fake_model("V").replace("\n", "\n  ")
    + "  capabilities: {in: [text, image], out: [text], tools: true, context: 8192}\n"
    + "    metadata: {capabilities: mine, family: qwen}\n"
    + fake_model("S").replace("\n", "\n  ")
    # A stop that takes a while: cmdStop does nothing, the kill comes after unloadTimeout.
    + f"  cmdStop: {sys.executable} -c pass\n    unloadTimeout: 3\n"
)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(Path(tmp_path_factory.mktemp("llama_swap_details")), CONFIG) as gateway:
        yield gateway


@pytest.fixture
def client(gw: Gateway) -> Iterator[httpx.Client]:
    with gw.client(headers=AUTH) as c:
        yield c


def test_gpulanes_own_errors_say_so_in_src(gw: Gateway, client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "nothing", "messages": []})
    assert r.status_code == 404 and r.json()["src"] == "gpulane"
    with gw.client() as anonymous:
        assert anonymous.get("/v1/models").json()["src"] == "gpulane"  # 401


def test_capabilities_are_rendered_into_v1_models_as_llama_swap_does(
    client: httpx.Client,
) -> None:
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    v = models["V"]
    assert v["architecture"] == {
        "input_modalities": ["text", "image"],
        "output_modalities": ["text"],
        "modality": "text+image->text",
    }
    assert v["capabilities"] == {"vision": True, "function_calling": True}
    assert v["supported_parameters"] == ["tools", "tool_choice"]
    assert v["context_length"] == 8192 and v["meta"]["n_ctx"] == 8192
    # The renderer's field names leave the metadata; the rest stays.
    assert v["meta"]["llamaswap"] == {"family": "qwen", "type": "model"}
    assert "capabilities" not in models["S"] and "architecture" not in models["S"]


def test_running_lists_a_model_being_stopped(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "S", "messages": messages}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    done: list[int] = []
    unload = threading.Thread(
        target=lambda: done.append(client.post("/api/models/unload/S").status_code)
    )
    unload.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            rows = {row["model"]: row for row in client.get("/running").json()["running"]}
            if rows.get("S", {}).get("state") == "stopping":
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.02)
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["S"]["status"] == {"value": "loaded"}  # as llama-swap counts it
        assert listed["S"]["state"] == "stopping"
    finally:
        unload.join(timeout=30)
    assert done == [200]
    assert "S" not in {row["model"] for row in client.get("/running").json()["running"]}
