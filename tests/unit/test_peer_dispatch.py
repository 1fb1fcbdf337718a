"""The core with peers (issue 24, item 4, app/core/peers.py): a peer's slots are
shared by its models, a request for a model several peers serve goes to a free
one (where it was last sent first, passing over a peer whose probe failed), and
affinity follows what was last sent to each peer. Pure: events in, decisions out."""

from __future__ import annotations

import textwrap

from app.config import parse_config
from app.core import events as ev
from app.core.policy import decide
from app.core.state import SchedulerState, apply
from app.runtime.parameters import server_started

T0 = 1_700_000_000 * 10**9
CONFIG = """
models:
  local:
    cmd: server --port ${PORT}
peers:
  box2:
    proxy: http://box2
    models: [a, b, m]
    concurrencyLimit: 2
  box3:
    proxy: http://box3
    models: [m]
"""


class Core:
    def __init__(self) -> None:
        self.state = SchedulerState()
        self.now = T0
        self.n = 0
        apply(self.state, server_started(parse_config(textwrap.dedent(CONFIG)), T0, 1))

    def fold(self, *events: ev.AnyEvent) -> None:
        for event in events:
            apply(self.state, event)

    def enqueue(self, model: str, priority: int = 0) -> str:
        self.n += 1
        self.now += 1
        rid = f"r{self.n}"
        self.fold(
            ev.RequestEnqueued(
                at=self.now,
                request_id=rid,
                model=model,
                model_requested=model,
                endpoint="/v1/chat/completions",
                priority=priority,
                band="normal",
            )
        )
        return rid

    def dispatch_all(self) -> list[ev.RequestDispatched]:
        out = []
        while (decision := decide(self.state, self.now)) is not None:
            self.fold(*decision.events)
            if decision.action == "swap":  # a probe that answers at once
                self.fold(
                    ev.SwapStarted(
                        at=self.now,
                        from_model=None,
                        to_model=decision.dispatched.model,
                        request_id=decision.dispatched.request_id,
                        evicted=[],
                    ),
                    ev.SwapFinished(at=self.now, model=decision.dispatched.model, duration_ms=0),
                )
            out.append(decision.dispatched)
        return out

    def finish(self, rid: str) -> None:
        self.fold(ev.RequestCompleted(at=self.now, request_id=rid, http_status=200))


def test_a_peers_slots_are_shared_by_its_models_in_score_order() -> None:
    core = Core()
    low = core.enqueue("box2/a", -100)
    mid = core.enqueue("box2/b", 0)
    top = core.enqueue("box2/a", 100)
    sent = core.dispatch_all()
    assert [(d.request_id, d.model) for d in sent] == [(top, "box2/a"), (mid, "box2/b")]
    core.finish(mid)
    assert [d.request_id for d in core.dispatch_all()] == [low]


def test_a_local_model_loads_beside_the_peers() -> None:
    core = Core()
    core.enqueue("box2/a")
    core.enqueue("local")
    assert [d.model for d in core.dispatch_all()] == ["box2/a", "local"]


def test_a_choice_goes_to_a_free_peer_where_it_was_last_sent_first() -> None:
    core = Core()
    first = core.enqueue("m")
    (d,) = core.dispatch_all()
    assert d.request_id == first and d.model == "box2/m"  # configuration order
    core.finish(first)
    fillers = [core.enqueue("box2/a"), core.enqueue("box2/a")]  # box2's two slots taken
    core.dispatch_all()
    busy = core.enqueue("m")
    assert [d.model for d in core.dispatch_all()] == ["box3/m"]  # the free one
    for rid in (busy, *fillers):
        core.finish(rid)
    # Both peers are free now: only where m was last sent (box3) sets it apart
    # from box2, which comes first in the configuration.
    core.enqueue("m")
    assert [d.model for d in core.dispatch_all()] == ["box3/m"]


def test_a_peer_whose_probe_failed_is_passed_over_for_a_choice() -> None:
    core = Core()
    core.fold(ev.SwapFailed(at=core.now, model="box2/m", error="peer 'box2' did not answer"))
    core.enqueue("m")
    assert [d.model for d in core.dispatch_all()] == ["box3/m"]


def test_affinity_follows_what_was_last_sent_to_the_peer() -> None:
    core = Core()
    rid = core.enqueue("box2/a")
    core.dispatch_all()
    core.finish(rid)
    rid = core.enqueue("box2/b")
    core.dispatch_all()
    core.finish(rid)
    assert "box2/b" in core.state.affine and "box2/a" not in core.state.affine
    assert "box2/a" in core.state.in_use  # reachable all the same
    rid = core.enqueue("m")
    core.dispatch_all()
    assert {"m", "box2/m"} <= core.state.affine and "box2/b" not in core.state.affine
