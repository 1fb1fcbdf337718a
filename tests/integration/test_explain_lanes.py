"""`explain` with a router and slots (issue 23, item 5): the wait is told in the
machine's terms (a free slot of M, M draining for R, M evicted by R), and the
parts still add up to the wait. A log of the real run loop on fake upstreams,
written to a real SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.report.explain import explain
from app.report.render import explanation_text
from app.report.visibility import story_seen_by
from app.runtime.parameters import server_started
from app.store.engine import open_database
from tests.unit.run_loop_fakes import T0_NS, Lane, config_text, settle
from tools.replay.generate import write_log


def two_lanes() -> str:
    """A (two slots) and B share gpu0; C is alone on gpu1."""
    entries: dict[str, dict[str, Any]] = {"A": {"concurrencyLimit": 2}, "B": {}, "C": {}}
    router = {
        "use": "group",
        "settings": {
            "groups": {
                "gpu0": {"swap": True, "exclusive": False, "members": ["A", "B"]},
                "gpu1": {"swap": True, "exclusive": False, "members": ["C"]},
            }
        },
    }
    return config_text(entries, router=router)


async def test_slot_drain_and_eviction_are_named_and_add_up(tmp_path: Path) -> None:
    lane = Lane(two_lanes())
    clock = lane.clock
    a1, a2, a3 = (lane.admit("A") for _ in range(3))
    await settle()
    assert lane.dispatched() == [a1.request_id, a2.request_id]  # a3: both slots taken
    await clock.advance(1)
    b1 = lane.admit("B", 100)  # higher: its load must evict A, so A drains for it
    await clock.advance(1)
    await lane.finish(a1)  # a free slot of A, but A drains: a3 stays
    assert a3.request_id not in lane.dispatched()
    await clock.advance(1)
    await lane.finish(a2)  # A has drained: b1's load evicts it
    assert lane.dispatched()[-1] == b1.request_id
    await clock.advance(2)
    await lane.finish(b1)  # A loads again for a3
    await lane.finish(a3)
    db = tmp_path / "lanes.db"
    write_log(db, [server_started(lane.config, T0_NS, 0), *lane.events()])
    engine = open_database(db)
    try:
        story = explain(engine, a3.request_id)
        theirs = explain(engine, b1.request_id)
    finally:
        engine.dispose()
    assert story is not None and theirs is not None
    parts = {p.cause: p.seconds for p in story.wait}
    assert parts == {"slot": 2.0, "drain": 1.0, "evicted": 2.0}
    assert abs(sum(parts.values()) - story.wait_s) < 1e-9 and story.wait_s == 5.0
    held = [(h.cause, h.model, h.request_id, h.seconds) for h in story.held_for]
    assert held == [
        ("slot", "A", None, 2.0),
        ("drain", "A", b1.request_id, 1.0),
        ("evicted", "A", b1.request_id, 2.0),
    ]
    text = explanation_text(story)
    assert "for a free slot of A" in text
    assert f"while A drained for {b1.request_id}" in text
    assert f"A evicted by {b1.request_id}" in text
    # b1 itself waited for A to drain for it
    assert [(p.cause, p.seconds) for p in theirs.wait] == [("drain", 2.0)]
    assert [(h.model, h.request_id) for h in theirs.held_for] == [("A", b1.request_id)]
    # A user key sees no other caller's request id (b1 has no caller: "another")
    seen = story_seen_by(story, "someone")
    assert all(h.request_id is None for h in seen.held_for if h.cause != "slot")
