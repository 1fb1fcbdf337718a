"""config.example.yaml served by gpulane in front of the real llama.cpp server and
the real SmolLM2 model: chat, streaming, a real swap, and priority order."""

from __future__ import annotations

import concurrent.futures as cf
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.gateway import REPO, Gateway, free_port_block, poll
from tools.fetch_llama import fetch

pytestmark = pytest.mark.llama
MESSAGES = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fetched = fetch()  # builds llama-server on first use
    text = (REPO / "config.example.yaml").read_text()
    # The example as a user runs it, but with this machine's cache and ports of its own.
    text = re.sub(r"(?m)^(\s*llama-server:).*$", rf'\1 "{fetched.server}"', text)
    text = re.sub(r'(?m)^(\s*smollm2:) "\$\{env.*$', rf'\1 "{fetched.model}"', text)
    text = re.sub(r"(?m)^startPort: \d+", f"startPort: {free_port_block()}", text)
    gateway = Gateway(Path(tmp_path_factory.mktemp("llama-gw")), text).start()
    yield gateway
    gateway.stop()


def client(gw: Gateway) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_through_gpulane_with_the_openai_client(gw: Gateway) -> None:
    reply = client(gw).chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=16,
        extra_headers={"X-LlamaSwap-Priority": "interactive"},
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    rows = gw.wait_for(
        "SELECT output_tokens, tokens_per_second FROM requests WHERE status='completed'"
    )
    assert rows[0]["output_tokens"] > 0 and rows[0]["tokens_per_second"] > 0


def test_streaming_through_gpulane(gw: Gateway) -> None:
    stream = client(gw).chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=16, stream=True
    )
    pieces = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 1 and "".join(pieces).strip()


def test_asking_for_the_other_entry_swaps_the_real_server(gw: Gateway) -> None:
    reply = client(gw).chat.completions.create(
        model="smollm2-long", messages=MESSAGES, max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    with gw.client() as http:
        running = http.get("/running").json()["running"]
    assert [m["model"] for m in running] == ["smollm2-long"]
    swaps = gw.wait_for(
        "SELECT duration_ms FROM swaps WHERE to_model='smollm2-long' AND duration_ms > 0"
    )
    assert swaps


def test_interactive_overtakes_batch_behind_a_real_generation(gw: Gateway) -> None:
    llm = client(gw)
    # Each request is sent once the one before it is in the queue (a fixed pause
    # may be too short on a loaded host): the long one running, then batch waiting.
    with cf.ThreadPoolExecutor(3) as pool, gw.client() as http:

        def queue() -> dict[str, Any]:
            return http.get("/api/queue").json()  # type: ignore[no-any-return]

        long = pool.submit(
            llm.chat.completions.create,
            model="smollm2",
            messages=MESSAGES,
            max_tokens=256,
            extra_body={"ignore_eos": True},
        )
        poll(lambda: queue()["running"], "the long generation to be dispatched")
        batch = pool.submit(
            llm.chat.completions.with_raw_response.create,
            model="smollm2",
            messages=MESSAGES,
            max_tokens=4,
            extra_headers={"X-LlamaSwap-Priority": "batch"},
        )
        poll(lambda: len(queue()["waiting"]) == 1, "the batch request to wait")
        inter = pool.submit(
            llm.chat.completions.with_raw_response.create,
            model="smollm2",
            messages=MESSAGES,
            max_tokens=4,
            extra_headers={"X-LlamaSwap-Priority": "interactive"},
        )
        # Both wait behind the long one (had it ended first, batch would run and
        # this never be seen).
        poll(
            lambda: (q := queue())["running"] and len(q["waiting"]) == 2,
            "both to wait behind the long generation",
        )
        long.result()
        ids = [f.result().headers["x-request-id"] for f in (batch, inter)]
    rows = gw.wait_for(
        "SELECT id FROM requests WHERE id IN (?, ?) AND status='completed' ORDER BY dispatched_at",
        *ids,
        count=2,
    )
    assert [r["id"] for r in rows] == [ids[1], ids[0]]
