"""The run loop with a router (`routing.router`): several models resident at
once, each `swap: true` group a lane of its own, loads in parallel, evictions
of exactly what the router names (issue 23, items 3-5). The real `Scheduler`
on the fakes of tests/unit/run_loop_fakes.py; every log must pass
`replay --verify`.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from app.core import events as ev
from app.runtime.api import Ticket
from app.runtime.parameters import server_started
from app.store.invariants import audit
from tests.unit.run_loop_fakes import Lane, config_text, settle
from tools.replay.verify import verify


def groups(**spec: dict[str, Any]) -> dict[str, Any]:
    return {"use": "group", "settings": {"groups": spec}}


def models(*names: str, **keys: Any) -> dict[str, dict[str, Any]]:
    return {name: dict(keys) for name in names}


def two_lanes(scheduler: str = "serial", **limits: int) -> str:
    """A and B share one lane (gpu0), C and D another (gpu1)."""
    entries = models("A", "B", "C", "D")
    for model, n in limits.items():
        entries[model]["concurrencyLimit"] = n
    return config_text(
        entries,
        scheduler,
        router=groups(
            gpu0={"swap": True, "exclusive": False, "members": ["A", "B"]},
            gpu1={"swap": True, "exclusive": False, "members": ["C", "D"]},
        ),
    )


def verified(lane: Lane) -> bool:
    """`replay --verify` of the lane's log, after the `server_started` serve records,
    as the store keeps it (encoded: the router decodes from its tag)."""
    log = [ev.decode(ev.encode(e)) for e in [server_started(lane.config, 0, 0), *lane.events()]]
    assert log[0] == server_started(lane.config, 0, 0)
    result = verify(enumerate(log, start=1))
    assert result.divergence is None, result.divergence.describe()
    assert audit(enumerate(log, start=1)).violations == []  # and `db check` finds it sound
    return result.decisions == len(lane.dispatched())


async def running(lane: Lane, model: str, priority: int = 0) -> Ticket:
    ticket = lane.admit(model, priority)
    await settle()
    assert ticket.ready.done(), f"the request for {model} did not start"
    return ticket


def evictions(lane: Lane) -> list[tuple[str, list[str] | None]]:
    return [(e.to_model, e.evicted) for e in lane.events(ev.SwapStarted)]


async def test_two_swap_groups_run_side_by_side() -> None:
    lane = Lane(two_lanes())
    job = await running(lane, "A")  # a long job on gpu0
    c = await running(lane, "C")  # not held by it: gpu1 loads C and runs it
    await lane.clock.advance(0.5)
    await lane.finish(c)  # C finishes first
    await lane.clock.advance(2)
    await lane.finish(job)
    assert lane.upstreams.calls == [("start", "A"), ("start", "C")]
    assert evictions(lane) == [("A", []), ("C", [])]
    assert lane.scheduler.residents == ["A", "C"]
    assert verified(lane)


async def test_fifo_with_groups_runs_other_lanes_side_by_side() -> None:
    lane = Lane(two_lanes("fifo", A=1))
    job = await running(lane, "A")
    c = await running(lane, "C")  # as llama-swap: another lane's process runs it
    b = lane.admit("B")  # gpu0 waits for A's job
    await settle()
    assert not b.ready.done()
    await lane.finish(c)
    await lane.finish(job)
    await lane.serve_all()
    assert evictions(lane) == [("A", []), ("C", []), ("B", ["A"])]
    assert ("stop", "C") not in lane.upstreams.calls
    assert verified(lane)


async def test_within_a_group_the_model_drains_then_swaps() -> None:
    lane = Lane(two_lanes(A=2))
    job = await running(lane, "A")
    other = await running(lane, "C")  # the other lane is busy too
    b = lane.admit("B", 100)  # needs A evicted: A drains
    low = lane.admit("A", 0)  # a free slot of A, but B outscores it
    await settle()
    assert not b.ready.done() and not low.ready.done()
    await lane.finish(job)  # A is idle: the swap happens at once
    assert b.ready.done() and not low.ready.done()
    assert evictions(lane)[-1] == ("B", ["A"])
    stopping = lane.events(ev.ProcessStopping)[-1]
    assert (stopping.model, stopping.reason) == ("A", "evicted")
    assert (stopping.evicted_for, stopping.evicted_by) == ("B", b.request_id)
    stopped = lane.events(ev.ProcessStopped)[-1]
    assert (stopped.evicted_for, stopped.evicted_by) == ("B", b.request_id)
    await lane.finish(other)
    await lane.serve_all()
    assert lane.order([b, low]) == [0, 1]
    assert ("stop", "C") not in lane.upstreams.calls
    assert verified(lane)


async def test_a_swap_false_group_keeps_a_while_b_loads() -> None:
    config = config_text(
        models("A", "B"), router=groups(pair={"swap": False, "members": ["A", "B"]})
    )
    lane = Lane(config, auto_load=False)
    a = lane.admit("A")
    await settle()
    lane.upstreams.last("A").load()
    await settle()
    assert a.ready.done()
    b = lane.admit("B")  # A is busy, and stays: B loads beside it
    await settle()
    assert lane.scheduler.residents == ["A"] and "B" in lane.scheduler.state.loads
    lane.upstreams.last("B").load()
    await settle()
    assert b.ready.done()
    assert lane.scheduler.residents == ["A", "B"]
    await lane.serve_all()
    assert lane.upstreams.calls == [("start", "A"), ("start", "B")]
    assert verified(lane)


async def test_a_persistent_group_is_never_evicted_by_another() -> None:
    config = config_text(
        models("P", "X", "Y"),
        router=groups(
            always={"persistent": True, "exclusive": False, "members": ["P"]},
            big={"exclusive": True, "members": ["X", "Y"]},
        ),
    )
    lane = Lane(config)
    await lane.finish(await running(lane, "P"))
    await lane.finish(await running(lane, "X"))  # exclusive, but P is persistent
    await lane.finish(await running(lane, "Y"))  # evicts its sibling X only
    assert lane.upstreams.calls == [("start", "P"), ("start", "X"), ("stop", "X"), ("start", "Y")]
    assert evictions(lane) == [("P", []), ("X", []), ("Y", ["X"])]
    assert lane.scheduler.residents == ["P", "Y"]
    assert verified(lane)


async def test_an_exclusive_group_evicts_the_others_once_they_drain() -> None:
    config = config_text(
        models("L", "E", "W"),
        router=groups(
            llm={"exclusive": True, "members": ["L"]},
            helpers={"swap": False, "exclusive": False, "members": ["E", "W"]},
        ),
    )
    lane = Lane(config)
    e_job = await running(lane, "E")
    await lane.finish(await running(lane, "W"))  # W resident, idle
    llm = lane.admit("L", 100)  # must evict E and W: both drain
    w = lane.admit("W", 0)  # W is resident with a free slot, but L waits on it
    await settle()
    assert not llm.ready.done() and not w.ready.done()
    await lane.finish(e_job)
    assert llm.ready.done()
    # Then W loads again beside L: a non-exclusive group's model evicts nothing
    # outside its group, even an exclusive one (llama-swap's rule).
    assert evictions(lane)[-2:] == [("L", ["E", "W"]), ("W", [])]
    assert lane.upstreams.calls[-4:] == [
        ("stop", "E"),
        ("stop", "W"),
        ("start", "L"),
        ("start", "W"),
    ]
    await lane.serve_all()
    assert lane.order([llm, w]) == [0, 1]
    assert verified(lane)


async def test_a_matrix_pair_runs_together_and_a_model_in_no_set_alone() -> None:
    config = config_text(
        models("a", "b", "c"),
        router={"use": "matrix", "settings": {"matrix": {"sets": {"pair": "a & b"}}}},
    )
    lane = Lane(config)
    a = await running(lane, "a")
    b = await running(lane, "b")  # together with a
    c = lane.admit("c")  # in no set: both must go, once idle
    await settle()
    assert not c.ready.done()
    await lane.finish(a)
    assert not c.ready.done()
    await lane.finish(b)
    assert c.ready.done()
    assert evictions(lane) == [("a", []), ("b", []), ("c", ["a", "b"])]
    await lane.serve_all()
    assert verified(lane)


async def test_preload_loads_every_model_the_router_lets_be_resident_together(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lane = Lane(two_lanes(), auto_load=False)
    with caplog.at_level(logging.WARNING, logger="gpulane.scheduler"):
        # In turn, as llama-swap: B evicts A in their lane, so B stays.
        assert lane.scheduler.preload_all(["A", "B", "C"]) == ["B", "C"]
    assert "'A' is not kept preloaded" in caplog.text and "'B', listed after it" in caplog.text
    await settle()
    # Two lanes: both load at once; A is never loaded only to be evicted.
    assert lane.upstreams.calls == [("start", "B"), ("start", "C")]
    assert evictions(lane) == [("B", []), ("C", [])]
    assert [e.request_id for e in lane.events(ev.SwapStarted)] == [None, None]
    lane.upstreams.last("C").load()
    lane.upstreams.last("B").load()
    await settle()
    assert sorted(lane.scheduler.residents) == ["B", "C"]
    c = await running(lane, "C")
    await lane.finish(c)
    assert verified(lane)


async def test_a_failed_load_in_a_group_fails_its_requests_and_leaves_the_other_lane() -> None:
    lane = Lane(two_lanes(), auto_load=False)
    a = lane.admit("A")
    await settle()
    lane.upstreams.last("A").load()
    await settle()
    assert a.ready.done()
    c = lane.admit("C")
    await settle()
    lane.upstreams.last("C").fail()
    await settle()
    failed = lane.ended(c)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 502
    assert lane.scheduler.residents == ["A"] and not lane.scheduler.state.loads
    c2 = lane.admit("C")  # C backs off (loadBackoff, 5 s), while A's job still runs
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("start", "C")]
    await lane.clock.advance(5)  # then loads again
    lane.upstreams.last("C").load()
    await settle()
    assert c2.ready.done()
    await lane.serve_all()
    assert lane.upstreams.calls == [("start", "A"), ("start", "C"), ("start", "C")]
    assert verified(lane)


async def test_ttl_stops_one_model_and_leaves_the_other_lane() -> None:
    entries = models("A", "C")
    entries["A"]["ttl"] = 2
    config = config_text(
        entries,
        router=groups(
            gpu0={"exclusive": False, "members": ["A"]},
            gpu1={"exclusive": False, "members": ["C"]},
        ),
    )
    lane = Lane(config)
    await lane.finish(await running(lane, "A"))
    c = await running(lane, "C")
    await lane.clock.advance(2)
    assert [(e.model, e.reason) for e in lane.events(ev.ProcessStopped)] == [("A", "ttl")]
    assert lane.scheduler.residents == ["C"]
    await lane.finish(c)
    assert verified(lane)


async def test_a_lower_request_may_not_load_a_model_a_waiting_swap_would_evict() -> None:
    config = config_text(
        models("L", "E", "X"),
        router=groups(
            llm={"exclusive": True, "members": ["L"]},
            helper={"exclusive": False, "members": ["E"]},
            extra={"exclusive": False, "members": ["X"]},
        ),
    )
    lane = Lane(config)
    e_job = await running(lane, "E")
    llm = lane.admit("L", 100)  # must evict E: waits for it to drain
    x = lane.admit("X", 0)  # X evicts nothing, but L would then have to evict X
    await settle()
    assert not llm.ready.done() and not x.ready.done()
    await lane.finish(e_job)
    assert llm.ready.done()
    await lane.serve_all()
    assert lane.order([llm, x]) == [0, 1]
    assert evictions(lane) == [("E", []), ("L", ["E"]), ("X", [])]
    assert verified(lane)


async def test_a_request_that_outscores_the_waiting_swap_still_takes_a_free_slot() -> None:
    lane = Lane(two_lanes(A=2))
    job = await running(lane, "A")
    b = lane.admit("B", 0)  # needs A evicted: A drains
    high = lane.admit("A", 100)  # outscores B: it takes A's free slot
    await settle()
    assert high.ready.done() and not b.ready.done()
    await lane.finish(job)
    assert not b.ready.done()  # A still runs `high`
    await lane.finish(high)
    assert b.ready.done()
    await lane.serve_all()
    assert verified(lane)
