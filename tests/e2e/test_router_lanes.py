"""Two groups, two lanes, end to end: a real `gpulane serve` over two fake
upstreams in two `swap: true` groups runs a slow request on A and a request on C
side by side (C finishes before A), and `replay --verify` reproduces every
decision (docs/scheduling.md, the dispatch rule with groups)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable
from typing import Any

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays

Start = Callable[[str], Gateway]

CONFIG = (
    "models:"
    + (fake_model("A") + fake_model("C")).replace("\n", "\n  ")
    + """
routing:
  router:
    use: group
    settings:
      groups:
        gpu0: {swap: true, exclusive: false, members: [A]}
        gpu1: {swap: true, exclusive: false, members: [C]}
hooks:
  on_startup:
    preload: [A, C]
"""
)


def chat(model: str, hold_file: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if hold_file:
        body["fake"] = {"hold_file": hold_file}
    return {"json": body}


def test_a_slow_request_on_a_does_not_hold_a_request_for_c(gateway: Start) -> None:
    gw = gateway(CONFIG)
    # The preload loads both models, one in each lane.
    poll(
        lambda: len(gw.sql("SELECT 1 FROM events WHERE type = 'swap_finished'")) == 2,
        "both preloads",
    )
    # A runs until C has its answer (a fixed run could end first on a slow host).
    release = gw.tmp / "release"
    with gw.client() as client, cf.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(client.post, "/v1/chat/completions", **chat("A", str(release)))
        try:
            poll(lambda: gw.sql("SELECT 1 FROM requests WHERE model = 'A'"), "A dispatched")
            fast = pool.submit(client.post, "/v1/chat/completions", **chat("C"))
            c = fast.result(timeout=30)
            assert c.status_code == 200
            assert not slow.done()  # C finished while A still runs
        finally:
            release.touch()
        a = slow.result(timeout=30)
    assert a.status_code == 200
    poll(lambda: not gw.sql("SELECT 1 FROM requests WHERE finished_at IS NULL"), "both recorded")
    rows = {
        r["model"]: r
        for r in gw.sql("SELECT model, started_at, finished_at FROM requests ORDER BY id")
    }
    assert rows["C"]["finished_at"] < rows["A"]["finished_at"]
    assert rows["C"]["started_at"] < rows["A"]["finished_at"]
    swaps = [
        json.loads(r["data"])
        for r in gw.sql("SELECT data FROM events WHERE type = 'swap_started' ORDER BY seq")
    ]
    assert [(s["to_model"], s["evicted"], s["request_id"]) for s in swaps] == [
        ("A", [], None),
        ("C", [], None),
    ]
    assert not gw.sql("SELECT 1 FROM events WHERE type = 'process_stopping'")
    started = json.loads(gw.sql("SELECT data FROM events WHERE type = 'server_started'")[0]["data"])
    assert started["router"]["type"] == "group"
    gw.stop()
    checked = gw.db_check()  # two loads in flight at once are sound: one per lane
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert_log_replays(gw.db)
