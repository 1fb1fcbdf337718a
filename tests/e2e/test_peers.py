"""Peers with the queue in front (issue 24, item 4), end to end: a front gpulane
whose `peers` is a second, real `gpulane serve` (fake upstreams behind it).

- `box2/some-model` (and the bare `some-model`) is served through the peer;
- with the peer's `concurrencyLimit` 1, the front sends one request at a time in
  score order (interactive first), and the peer sees them in that order;
- a peer that is down is a recorded failure with a clear error, and the next
  request is served, by another peer serving the model when there is one;
- `replay --verify` passes on the front's log.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.gateway import Gateway, fake_model, free_port, poll
from tests.e2e.log_replay import assert_log_replays

Start = Callable[[str, str], Gateway]


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Start]:
    """host(name, config) starts a `gpulane serve` in a folder of its own."""
    started: list[Gateway] = []

    def start(name: str, config_text: str) -> Gateway:
        folder = tmp_path / name
        folder.mkdir()
        gw = Gateway(folder, config_text).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


def models(*names: str) -> str:
    return "models:" + "".join(fake_model(n) for n in names).replace("\n", "\n  ") + "\n"


def chat(
    model: str, caller: str, priority: str = "normal", delay: float = 0.0, hold_file: str = ""
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if delay or hold_file:
        body["fake"] = {"delay": delay, "hold_file": hold_file or None}
    return {
        "json": body,
        "headers": {"X-LlamaSwap-Priority": priority, "X-Gpulane-Caller": caller},
    }


def peer_block(peers: dict[str, tuple[str, list[str]]]) -> str:
    lines = ["peers:"]
    for name, (url, served) in peers.items():
        lines += [f"  {name}:", f"    proxy: {url}", f"    models: {json.dumps(served)}"]
    return "\n".join(lines) + "\n"


def test_a_peer_model_is_served_through_the_peer(host: Start) -> None:
    back = host("box2", models("some-model"))
    front = host("front", models("here") + peer_block({"box2": (back.url, ["some-model"])}))
    with front.client() as client:
        full = client.post("/v1/chat/completions", **chat("box2/some-model", "u"))
        bare = client.post("/v1/chat/completions", **chat("some-model", "u"))
        local = client.post("/v1/chat/completions", **chat("here", "u"))
        listed = {m["id"] for m in client.get("/v1/models").json()["data"]}
    for answer in (full, bare):
        assert answer.status_code == 200, answer.text
        assert answer.json()["served_by"] == "some-model"
        assert answer.json()["model"] == "some-model"  # the peer's own name for it
    assert local.json()["served_by"] == "here"
    assert "box2/some-model" in listed
    dispatched = front.wait_for(
        "SELECT model FROM events WHERE type = 'request_dispatched' ORDER BY seq", count=3
    )
    assert [r["model"] for r in dispatched] == ["box2/some-model", "box2/some-model", "here"]
    assert len(back.wait_for("SELECT id FROM requests WHERE status = 'completed'", count=2)) == 2
    front.stop()
    assert_log_replays(front.db)


def test_the_front_sends_the_peer_one_request_at_a_time_in_score_order(
    host: Start, tmp_path: Path
) -> None:
    back = host("box2", models("some-model"))
    front = host("front", models("here") + peer_block({"box2": (back.url, ["some-model"])}))
    order = [("batch", "batch"), ("normal", "normal"), ("inter", "interactive")]
    # The slow one runs until all three wait at the front: a fixed run could end
    # first on a slow host, and the first of them go to the peer before the others came.
    release = tmp_path / "release"
    with front.client() as client, cf.ThreadPoolExecutor(4) as pool:
        slow = pool.submit(
            client.post,
            "/v1/chat/completions",
            **chat("box2/some-model", "slow", hold_file=str(release)),
        )
        try:
            poll(
                lambda: back.sql("SELECT 1 FROM requests WHERE caller = 'slow'"),
                "slow at the peer",
            )
            waiting = []
            for n, (caller, priority) in enumerate(order, start=1):
                waiting.append(
                    pool.submit(
                        client.post,
                        "/v1/chat/completions",
                        **chat("box2/some-model", caller, priority),
                    )
                )
                poll(
                    lambda n=n: (
                        len(front.sql("SELECT 1 FROM requests WHERE status = 'queued'")) == n
                    ),
                    f"{caller} queued at the front",
                )
            # The peer has one slot's worth: nothing more was sent while slow runs.
            assert len(back.sql("SELECT 1 FROM requests")) == 1
        finally:
            release.touch()
        assert all(f.result(timeout=30).status_code == 200 for f in [slow, *waiting])
    expected = ["slow", "inter", "normal", "batch"]
    sent = front.wait_for(
        "SELECT r.caller FROM events e JOIN requests r ON r.id = e.request_id "
        "WHERE e.type = 'request_dispatched' ORDER BY e.seq",
        count=4,
    )
    assert [r["caller"] for r in sent] == expected
    seen = back.wait_for("SELECT caller FROM requests ORDER BY enqueued_at", count=4)
    assert [r["caller"] for r in seen] == expected
    front.stop()
    assert_log_replays(front.db)


def test_a_peer_that_is_down_fails_clearly_and_the_next_request_is_served(host: Start) -> None:
    back = host("box3", models("some-model"))
    dead = f"http://127.0.0.1:{free_port()}"
    peers = {"box2": (dead, ["some-model", "only-here"]), "box3": (back.url, ["some-model"])}
    front = host("front", models("here") + peer_block(peers))
    with front.client() as client:
        down = client.post("/v1/chat/completions", **chat("box2/only-here", "u"))
        # Several peers serve some-model: box2 (first in order) does not answer,
        # so the request is retried on box3.
        retried = client.post("/v1/chat/completions", **chat("some-model", "u"))
        local = client.post("/v1/chat/completions", **chat("here", "u"))
    assert down.status_code == 502
    error = down.json()["error"]["message"]
    assert f"peer 'box2' at {dead} did not answer" in error, error
    assert retried.status_code == 200 and retried.json()["served_by"] == "some-model"
    assert local.status_code == 200
    failed = front.wait_for("SELECT error FROM requests WHERE status = 'failed'")
    assert len(failed) == 1 and "peer 'box2'" in failed[0]["error"]
    swaps = front.wait_for(
        "SELECT model FROM events WHERE type = 'swap_failed' ORDER BY seq", count=2
    )
    assert [r["model"] for r in swaps] == ["box2/only-here", "box2/some-model"]
    dispatched = front.wait_for(
        "SELECT model FROM events WHERE type = 'request_dispatched' ORDER BY seq", count=4
    )
    assert [r["model"] for r in dispatched] == [
        "box2/only-here",
        "box2/some-model",
        "box3/some-model",
        "here",
    ]
    assert len(front.sql("SELECT 1 FROM events WHERE type = 'request_requeued'")) == 1
    front.stop()
    assert_log_replays(front.db)
