"""The run loop with peers (issue 24, item 4), against fakes: no process starts
for a peer's model (its load is a probe), a peer's slots bound what is sent to
it, a probe that fails is a recorded failure with its reason, and a request a
peer failed goes to another peer that serves its model; every log verifies."""

from __future__ import annotations

import textwrap

from app.config import ModelConfig
from app.core import events as ev
from app.runtime.upstream import UpstreamStartError
from tests.unit.run_loop_fakes import Lane, settle
from tests.unit.test_scheduler_router import verified

CONFIG = textwrap.dedent(
    """
    models:
      local:
        cmd: server --port ${PORT}
    peers:
      box2:
        proxy: http://box2:8080
        apiKey: k2
        models: [a, m]
      box3:
        proxy: http://box3:8080
        models: [m]
    """
)


class Probes:
    """The peers' reachability checks: `down` peers do not answer."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.calls: list[str] = []

    async def __call__(self, spec: ModelConfig) -> None:
        assert spec.peer is not None
        self.calls.append(spec.id)
        if spec.peer in self.down:
            raise UpstreamStartError(f"peer {spec.peer!r} at {spec.proxy} did not answer")


def lane() -> tuple[Lane, Probes]:
    lane = Lane(CONFIG)
    probes = Probes()
    lane.scheduler.processes.probe_peer = probes
    return lane, probes


async def test_a_peer_model_starts_no_process_and_runs_at_the_peers_url() -> None:
    peers, probes = lane()
    first = peers.admit("box2/a")
    second = peers.admit("box2/a", 100)
    await settle()
    assert first.ready.result() == "http://box2:8080" and not second.ready.done()
    assert peers.upstreams.calls == [] and probes.calls == ["box2/a"]
    await peers.finish(first)
    assert second.ready.result() == "http://box2:8080"  # one slot: after the first
    await peers.serve_all()
    assert probes.calls == ["box2/a"]  # checked once
    assert verified(peers)


async def test_a_peer_that_is_down_fails_the_request_with_the_reason() -> None:
    peers, probes = lane()
    probes.down.add("box2")
    ticket = peers.admit("box2/a")
    local = peers.admit("local")
    await settle()
    failed = peers.ended(ticket)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 502
    assert "peer 'box2' at http://box2:8080 did not answer" in failed.error
    await peers.serve_all()  # the queue moved on
    assert isinstance(peers.ended(local), ev.RequestCompleted)
    assert verified(peers)


async def test_a_request_a_peer_failed_goes_to_another_peer_serving_its_model() -> None:
    peers, probes = lane()
    probes.down.add("box2")
    ticket = peers.admit("m")
    await settle()
    assert ticket.ready.result() == "http://box3:8080"
    assert peers.scheduler.target_of(ticket.request_id, "m") == "box3/m"
    assert probes.calls == ["box2/m", "box3/m"]
    assert [e.model for e in peers.events(ev.RequestDispatched)] == ["box2/m", "box3/m"]
    assert len(peers.events(ev.RequestRequeued)) == 1
    assert [e.model for e in peers.events(ev.SwapFailed)] == ["box2/m"]
    await peers.serve_all()
    assert isinstance(peers.ended(ticket), ev.RequestCompleted)
    assert verified(peers)


async def test_a_peer_that_refuses_a_dispatched_request_is_checked_again() -> None:
    peers, probes = lane()
    ticket = peers.admit("m")
    await settle()
    assert ticket.ready.result() == "http://box2:8080"
    probes.down.add("box2")  # box2 went away after its check
    assert await peers.scheduler.reload_crashed(ticket.request_id)
    assert peers.scheduler.target_of(ticket.request_id, "m") == "box3/m"
    assert ticket.ready.result() == "http://box3:8080"
    await peers.serve_all()
    assert isinstance(peers.ended(ticket), ev.RequestCompleted)
    assert verified(peers)
