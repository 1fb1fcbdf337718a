"""The real llama.cpp server with the real SmolLM2 model, talked to directly (no proxy).

The session fixture builds llama-server on first use (`tools.fetch_llama`, about four
minutes on two cores; later runs find it in ~/.cache/gpulane), starts it on a free port
and stops it at the end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tools.fetch_llama import fetch

pytestmark = pytest.mark.llama

STARTUP_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
MESSAGES = [{"role": "user", "content": "Say hello in five words."}]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def llama_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fetched = fetch()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("llama") / "llama-server.log"
    cmd = [
        str(fetched.server),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-m",
        str(fetched.model),
        "-c",
        "2048",
    ]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server not healthy in {STARTUP_TIMEOUT_S}s:\n{_tail(log_path)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_chat_completion(llama_url: str) -> None:
    r = httpx.post(
        f"{llama_url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 24, "temperature": 0},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_completion_stream(llama_url: str) -> None:
    payloads: list[str] = []
    with httpx.stream(
        "POST",
        f"{llama_url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True},
        timeout=REQUEST_TIMEOUT_S,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                payloads.append(line[len("data:") :].strip())

    assert payloads, "no SSE data lines"
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) >= 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    assert text.strip()
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert finishes[-1] in ("stop", "length")
