"""`explain` with a router and slots (issue 23, item 5): the wait is told in the
machine's terms (a free slot of M, M draining for R, M evicted by R), and the
parts still add up to the wait. A log of the real run loop on fake upstreams,
written to a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.core import events as ev
from app.core.state import SchedulerState, apply
from app.report.explain import explain
from app.report.render import explanation_text
from app.report.visibility import story_seen_by
from app.runtime.parameters import server_started
from app.store.engine import open_database
from app.store.explain_queries import LoggedEvent, residency_events
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


def fold(logged: Iterable[LoggedEvent]) -> tuple[object, ...]:
    """What a fold of `logged` says of residency, footprints, load costs and failures."""
    state = SchedulerState()
    for _, data in logged:
        apply(state, ev.decode(data))
    return (
        list(state.residents),
        dict(state.loads),
        state.asleep,
        state.measured_mib,
        state.load_cost_ns,
        {m: f.count for m, f in state.load_failures.items()},
        state.in_use,
    )


async def test_under_a_router_each_models_events_since_its_last_load_fold_as_all_do(
    tmp_path: Path,
) -> None:
    """Three models under the memory router, two fitting at a time, one load
    failing: at every point of the log, explain's fold of each model's events
    since its last finished load (`since_loads`) is the fold of them all."""
    size = {"gpuMemory": "30GiB"}
    memory = {"use": "memory", "settings": {"memory": {"budget": "80GiB"}}}
    lane = Lane(config_text({"A": size, "B": size, "C": size}, router=memory))
    clock = lane.clock
    for model in "AB":
        ticket = lane.admit(model)
        await clock.advance(1)
        await lane.finish(ticket)
    lane.upstreams.auto_load = False
    failing = lane.admit("C")
    await settle()
    lane.upstreams.last("C").fail()
    await settle()
    assert lane.ended(failing).http_status >= 500
    lane.upstreams.auto_load = True
    await clock.advance(600)  # past its load back-off
    for model in "CACBBA":
        ticket = lane.admit(model)
        await clock.advance(1)
        await lane.finish(ticket)
    db = tmp_path / "memory.db"
    write_log(db, [server_started(lane.config, T0_NS, 0), *lane.events()])
    engine = open_database(db)
    try:
        with engine.connect() as conn:
            last = conn.exec_driver_sql("SELECT max(seq) FROM events").scalar()
            assert last is not None
            for start in range(2, last + 2):
                whole = fold(residency_events(conn, 1, start, 0.0))
                assert fold(residency_events(conn, 1, start, 0.0, since_loads=True)) == whole
            resident = whole[0]  # at the end: C loaded since its failure, two models loaded
            assert whole[5] == {} and isinstance(resident, list) and len(resident) == 2
            ids = [r[0] for r in conn.exec_driver_sql("SELECT id FROM requests")]
        stories = [explain(engine, rid) for rid in ids]
    finally:
        engine.dispose()
    assert len(stories) == 9 and all(s is not None and s.replay_matches for s in stories)
