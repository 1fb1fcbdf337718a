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

# A stop that lasts until the test says: cmdStop waits for a file (at most 60 s),
# then stops the server. (A stop of a fixed 3 s ended, on a loaded host, before
# the test had read both lists.)
STOPPER = """\
import os, signal, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
os.kill(int(sys.argv[2]), signal.SIGTERM)
"""


def config(stopper: Path, release: Path) -> str:
    return (
        f"apiKeys: [{KEY}]\nmodels:"
        + fake_model("V").replace("\n", "\n  ")
        + "  capabilities: {in: [text, image], out: [text], tools: true, context: 8192}\n"
        + "    metadata: {capabilities: mine, family: qwen}\n"
        + fake_model("S").replace("\n", "\n  ")
        + f"  cmdStop: {sys.executable} {stopper} {release} ${{PID}}\n    unloadTimeout: 90\n"
    )


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = Path(tmp_path_factory.mktemp("llama_swap_details"))
    stopper = tmp / "stopper.py"
    stopper.write_text(STOPPER)
    with running_gateway(tmp, config(stopper, tmp / "release-stop")) as gateway:
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


def test_running_lists_a_model_being_stopped(gw: Gateway, client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "S", "messages": messages}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    done: list[int] = []
    unload = threading.Thread(
        target=lambda: done.append(client.post("/api/models/unload/S").status_code)
    )
    unload.start()
    try:
        deadline = time.monotonic() + 30  # a hang guard
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
        (gw.tmp / "release-stop").touch()
        unload.join(timeout=30)
    assert done == [200]
    assert "S" not in {row["model"] for row in client.get("/running").json()["running"]}
