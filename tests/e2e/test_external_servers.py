"""A model served by a server started elsewhere (issue 28, item 6), as in
llama-swap: its `proxy` points at a server that already runs, its `cmd` is a
placeholder; gpulane serves through it and never stops it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import REPO, Gateway, free_port, poll


@pytest.fixture
def external() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    argv = [sys.executable, "-m", "tools.fake_upstream", "--port", str(port), "--name", "ollama"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL)

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    poll(answers, "the external server", timeout=30)
    try:
        yield port, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_placeholder_cmd_serves_through_a_server_started_elsewhere(
    tmp_path: Path, external: tuple[int, subprocess.Popen[bytes]]
) -> None:
    port, server = external
    config = (
        f"models:\n  E:\n    cmd: sleep 300\n    proxy: http://127.0.0.1:{port}\n"
        "    checkEndpoint: /health\n"
    )
    gw = Gateway(tmp_path, config).start()
    try:
        with gw.client() as client:
            r = client.post("/v1/chat/completions", json={"model": "E", "messages": []})
            assert r.status_code == 200, r.text
            assert r.headers["x-served-by"] == "ollama"
            assert client.post("/api/models/unload/E").text == "OK"
            assert client.get("/running").json()["running"] == []
        assert server.poll() is None  # stopping the model stopped the placeholder only
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        gw.stop()
