"""Serial with slots in front of the real llama.cpp server: a model started with
`--parallel 4` and `concurrencyLimit: 4` has four requests in flight at once, in
gpulane's log and in llama-server's own slots (docs/scheduling.md, Slots and the
dispatch rule)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import Gateway, poll
from tests.e2e.log_replay import assert_log_replays
from tools.fetch_llama import fetch

pytestmark = pytest.mark.llama


def test_four_requests_run_at_once_on_a_four_slot_llama_server(tmp_path: Path) -> None:
    fetched = fetch()  # builds llama-server on first use
    cmd = f"{fetched.server} --host 127.0.0.1 --port ${{PORT}} -m {fetched.model}"
    config = f"""
models:
  smollm2:
    cmd: "{cmd} -c 2048 --parallel 4"
    concurrencyLimit: 4
"""
    gw = Gateway(tmp_path, config).start()
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to fifty."}]}
        with gw.client(timeout=180) as client:
            warm = client.post("/v1/chat/completions", json=body | {"max_tokens": 4})
            assert warm.status_code == 200, warm.text
            started = gw.wait_for("SELECT data FROM events WHERE type = 'process_started'")
            port = json.loads(started[0]["data"])["port"]
            busy: list[int] = []

            def processing() -> int:
                slots = httpx.get(f"http://127.0.0.1:{port}/slots", timeout=5).json()
                return sum(1 for s in slots if s.get("is_processing"))

            with cf.ThreadPoolExecutor(4) as pool:
                replies = [
                    pool.submit(
                        client.post,
                        "/v1/chat/completions",
                        json=body | {"max_tokens": 96, "temperature": 0},
                    )
                    for _ in range(4)
                ]
                poll(lambda: busy.append(processing()) or max(busy) == 4, "four busy slots", 60)
                results = [r.result(timeout=180) for r in replies]
        assert [r.status_code for r in results] == [200] * 4
        ids = [r.headers["x-request-id"] for r in results]
        rows = gw.wait_for(
            "SELECT type, request_id FROM events WHERE type IN "
            "('request_dispatched', 'request_completed') ORDER BY seq",
            count=10,
        )
        mine = [r["type"] for r in rows if r["request_id"] in ids]
        assert mine[:4] == ["request_dispatched"] * 4  # all four before any ends
    finally:
        gw.stop()
    assert_log_replays(gw.db)
