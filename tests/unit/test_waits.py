"""What each waiting request waits for (issue 23, item 5): a free slot of its
model, a model draining for a higher request, a load; as `/api/queue` and
`gpulane queue` show it (app/report/waits.py). The real run loop on fakes."""

from __future__ import annotations

from typing import Any

import msgspec

from app.report.live_queue import queue_view
from app.report.render import queue_text
from app.report.run_times import RunTimes
from app.report.visibility import queue_seen_by
from app.report.waits import WaitsFor, waits_for
from tests.unit.run_loop_fakes import Lane, config_text, settle


def two_lanes() -> str:
    """A (two slots) and B share gpu0; C and D share gpu1."""
    entries: dict[str, dict[str, Any]] = {"A": {"concurrencyLimit": 2}, "B": {}, "C": {}, "D": {}}
    groups = {
        "gpu0": {"swap": True, "exclusive": False, "members": ["A", "B"]},
        "gpu1": {"swap": True, "exclusive": False, "members": ["C", "D"]},
    }
    return config_text(entries, router={"use": "group", "settings": {"groups": groups}})


def shown(lane: Lane) -> dict[str, WaitsFor | None]:
    state = lane.scheduler.state
    view = queue_view(state, {}, lane.clock(), RunTimes())
    return {w.request_id: w.waits_for for w in view.waiting}


async def test_a_slot_a_drain_and_a_load_each_named() -> None:
    lane = Lane(two_lanes())
    a1, a2, a3 = (lane.admit("A") for _ in range(3))
    c1 = lane.admit("C")
    d1 = lane.admit("D")  # C's sibling: D loads once C drains
    await settle()
    assert shown(lane) == {
        a3.request_id: WaitsFor("slot", "A"),
        d1.request_id: WaitsFor("drain", "C", for_itself=True),  # not "for d1" on d1's row
    }
    view = queue_view(lane.scheduler.state, {}, lane.clock(), RunTimes())
    assert "waits for C to drain for its own load" in queue_text(view)
    assert f"for {d1.request_id}" not in queue_text(view)
    b1 = lane.admit("B", 100)  # its load must evict A
    await settle()
    assert shown(lane)[b1.request_id] == WaitsFor("drain", "A", for_itself=True)
    assert shown(lane)[a3.request_id] == WaitsFor("slot", "A")  # still full
    await lane.finish(a1)
    # a free slot of A, but A drains for b1: a3 waits for that
    assert shown(lane)[a3.request_id] == WaitsFor("drain", "A", b1.request_id)
    view = queue_view(lane.scheduler.state, {}, lane.clock(), RunTimes())
    assert f"waits for A to drain for {b1.request_id}" in queue_text(view)
    # A user key sees that A drains, not for whom (b1 is not its request)
    mine = msgspec.structs.replace(
        view, waiting=[msgspec.structs.replace(w, caller="me") for w in view.waiting]
    )
    a3_row = next(w for w in queue_seen_by(mine, "me").waiting if w.request_id == a3.request_id)
    assert a3_row.waits_for == WaitsFor("drain", "A", another_caller=True)
    assert a3_row.waits_for.text() == "A to drain for another caller's request"
    await lane.finish(a2)  # b1's load evicts A
    state = lane.scheduler.state
    # A was evicted: its load now waits for B (running b1) to drain, for a3
    assert waits_for(state, "A") == WaitsFor("drain", "B", a3.request_id)
    await lane.finish(c1)
    await lane.serve_all()
    assert not state.requests
