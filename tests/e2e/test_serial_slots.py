"""Serial with slots, end to end: a real `gpulane serve` over fake upstreams runs a
model's `concurrencyLimit` requests at once, drains it for a higher-scored request
for another model, and `replay --verify` reproduces every decision
(docs/scheduling.md, Slots and the dispatch rule)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable
from typing import Any

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays

Start = Callable[[str], Gateway]


def config(**limits: int) -> str:
    models = ""
    for name, limit in limits.items():
        entry = fake_model(name)
        if limit:
            entry += f"  concurrencyLimit: {limit}\n"
        models += entry.replace("\n", "\n  ")
    return "models:" + models + "\n"


def chat(
    model: str, priority: str | None = None, delay: float = 0.0, hold_file: str = ""
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if delay or hold_file:
        body["fake"] = {"delay": delay, "hold_file": hold_file or None}
    headers = {"X-LlamaSwap-Priority": priority} if priority else {}
    return {"json": body, "headers": headers}


def log(gw: Gateway) -> list[tuple[str, str | None]]:
    """(type, request id) of every dispatch and terminal event, in log order."""
    rows = gw.sql(
        "SELECT type, request_id FROM events WHERE type IN "
        "('request_dispatched', 'request_completed', 'request_failed') ORDER BY seq"
    )
    return [(r["type"], r["request_id"]) for r in rows]


def completed(gw: Gateway, count: int) -> list[tuple[str, str | None]]:
    """The log of `log` once `count` requests have completed."""

    def done() -> list[tuple[str, str | None]] | None:
        events = log(gw)
        return events if sum(t == "request_completed" for t, _ in events) >= count else None

    return poll(done, f"{count} completions")  # type: ignore[no-any-return]


def dispatched(gw: Gateway) -> list[str]:
    return [rid for t, rid in log(gw) if t == "request_dispatched" and rid]


def test_three_slow_requests_overlap_on_a_three_slot_model_and_the_log_verifies(
    gateway: Start,
) -> None:
    gw = gateway(config(A=3, B=0))
    # Each runs until all three run: sent at once, they may still arrive far apart
    # on a slow host, past any fixed run.
    release = gw.tmp / "release"
    with gw.client() as client:
        assert client.post("/v1/chat/completions", **chat("A")).status_code == 200  # load A
        with cf.ThreadPoolExecutor(3) as pool:
            sent = [
                pool.submit(
                    client.post, "/v1/chat/completions", **chat("A", hold_file=str(release))
                )
                for _ in range(3)
            ]
            try:
                poll(lambda: len(dispatched(gw)) == 4, "three running on A")
            finally:
                release.touch()
            replies = [f.result(timeout=30) for f in sent]
    assert [r.status_code for r in replies] == [200, 200, 200]
    ids = {r.headers["x-request-id"] for r in replies}
    events = completed(gw, 4)
    mine = [(t, rid) for t, rid in events if rid in ids]
    # all three dispatched before the first of them completes
    assert [t for t, _ in mine[:3]] == ["request_dispatched"] * 3
    rows = gw.sql(
        "SELECT started_at, finished_at FROM requests WHERE id IN (?, ?, ?)", *sorted(ids)
    )
    assert max(r["started_at"] for r in rows) < min(r["finished_at"] for r in rows)
    started = json.loads(gw.sql("SELECT data FROM events WHERE type = 'server_started'")[0]["data"])
    assert started["concurrency"] == {"A": 3, "B": 1}
    gw.stop()
    assert_log_replays(gw.db)


def test_a_higher_request_for_another_model_drains_the_slots_then_swaps(gateway: Start) -> None:
    gw = gateway(config(A=3, B=0))
    with gw.client() as client, cf.ThreadPoolExecutor(5) as pool:
        assert client.post("/v1/chat/completions", **chat("A")).status_code == 200  # load A
        slow = [
            pool.submit(client.post, "/v1/chat/completions", **chat("A", delay=2.0))
            for _ in range(2)
        ]
        poll(lambda: len(dispatched(gw)) == 3, "two running on A")
        b = pool.submit(client.post, "/v1/chat/completions", **chat("B", delay=0.2))
        poll(lambda: gw.sql("SELECT 1 FROM requests WHERE model = 'B'"), "B queued")
        # A has a free slot, but B scores higher: this batch request waits for B
        later = pool.submit(
            client.post, "/v1/chat/completions", **chat("A", priority="batch", delay=0.1)
        )
        replies = [f.result(timeout=30) for f in (*slow, b, later)]
    assert [r.status_code for r in replies] == [200] * 4
    slow_ids = [r.headers["x-request-id"] for r in replies[:2]]
    b_id, later_id = (r.headers["x-request-id"] for r in replies[2:])
    events = completed(gw, 5)
    at = {(t, rid): i for i, (t, rid) in enumerate(events)}
    b_start = at[("request_dispatched", b_id)]
    assert all(at[("request_completed", rid)] < b_start for rid in slow_ids)  # drained first
    assert at[("request_completed", b_id)] < at[("request_dispatched", later_id)]
    swaps = gw.sql("SELECT data FROM events WHERE type = 'swap_started' ORDER BY seq")
    assert [json.loads(r["data"])["to_model"] for r in swaps] == ["A", "B", "A"]
    gw.stop()
    assert_log_replays(gw.db)
