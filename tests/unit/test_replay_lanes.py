"""What-if resources in the replay (issue 23, item 6): the simulator runs several
lanes and slots on the same core, and its model of requests sharing a model's
slots (each runs its own run time, unaffected by its neighbours) is checked
against a log the real run loop wrote with slots and two lanes."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from app.core import events as ev
from app.core.residency import Group, GroupRouter, MatrixRouter, MatrixSet
from app.core.scoring import NS_PER_S, ScoringParams
from app.runtime.api import Ticket
from app.runtime.parameters import server_started
from tests.unit.run_loop_fakes import FakeUpstream, Lane, config_text
from tools.replay import simulate as simulate_module
from tools.replay.cli import replay_command
from tools.replay.generate import CHAT, IMAGE, VIDEO, film
from tools.replay.resources import ResourcesError, load_resources
from tools.replay.simulate import Policy, simulate
from tools.replay.verify import verify
from tools.replay.workload import Request, RunResult, SwapTimes, Workload, extract_events

S = NS_PER_S
WHATIF = Path(__file__).parents[2] / "tools" / "replay" / "whatif"


def two_lanes_with_slots() -> str:
    """A (three slots) and B share gpu0; C (two slots) and D share gpu1."""
    entries: dict[str, dict[str, Any]] = {
        "A": {"concurrencyLimit": 3},
        "B": {},
        "C": {"concurrencyLimit": 2},
        "D": {},
    }
    router = {
        "use": "group",
        "settings": {
            "groups": {
                "gpu0": {"swap": True, "exclusive": False, "members": ["A", "B"]},
                "gpu1": {"swap": True, "exclusive": False, "members": ["C", "D"]},
            }
        },
    }
    return config_text(entries, router=router)


LOAD_S = {"A": 3.0, "B": 5.0, "C": 2.0, "D": 4.0}


async def recorded_run(seed: int) -> tuple[list[ev.AnyEvent], int]:
    """The real `Scheduler` on fake upstreams and a fake clock: 60 requests over
    four models at random times and priorities, each running a fixed time once
    started, each load taking its model's time. Returns the log and how many
    times two or more requests of one model ran at once."""
    rng = random.Random(seed)
    lane = Lane(two_lanes_with_slots(), auto_load=False)
    clock, scheduler = lane.clock, lane.scheduler
    spawn = lane.upstreams.__call__

    def upstream(spec: Any, on_spawn: Any) -> FakeUpstream:
        made = spawn(spec, on_spawn)

        def spawned(u: Any) -> None:
            on_spawn(u)
            clock.call_later(LOAD_S[spec.id], made.load)

        made._on_spawn = spawned
        return made

    scheduler.processes.new_upstream = upstream
    tickets: list[Ticket] = []

    def arrive(model: str, priority: int, run_s: float) -> None:
        ticket = lane.admit(model, priority)
        tickets.append(ticket)

        def ready(_: object) -> None:
            scheduler.started(ticket.request_id)
            clock.call_later(
                run_s, lambda: scheduler.completed(ticket.request_id, 200, run_ms=run_s * 1e3)
            )

        ticket.ready.add_done_callback(ready)

    at = 0.0
    for _ in range(60):
        at += rng.expovariate(1 / 4)
        model = rng.choice("AAAABCCD")
        priority = rng.choice((-100, 0, 0, 100))
        run_s = round(rng.uniform(2, 20), 3)
        clock.call_later(at, arrive, model, priority, run_s)
    await clock.advance(at + 3600)
    assert not scheduler.state.requests
    log = [server_started(lane.config, 0, 0), *lane.events()]
    log = [ev.decode(ev.encode(e)) for e in log]
    assert verify(enumerate(log, start=1)).divergence is None
    overlaps = 0
    running: dict[str, int] = {}
    for e in log:
        if isinstance(e, ev.RequestStarted):
            model = next(t.model for t in tickets if t.request_id == e.request_id)
            running[model] = running.get(model, 0) + 1
            overlaps += running[model] > 1
        elif isinstance(e, ev.RequestCompleted):
            model = next(t.model for t in tickets if t.request_id == e.request_id)
            running[model] -= 1
    return log, overlaps


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_simulation_reproduces_a_recorded_multi_slot_two_lane_run(seed: int) -> None:
    log, overlaps = await recorded_run(seed)
    assert overlaps >= 5  # the slots were used: requests of one model ran side by side
    workload = extract_events(enumerate(log, start=1), chain_gap_ns=0)
    assert workload.router is not None and workload.slots == {"A": 3, "C": 2}
    recorded = workload.recorded
    assert recorded is not None
    policy = Policy(
        "recorded",
        workload.params,
        router=workload.router,
        slots=tuple(sorted(workload.slots.items())),
    )
    result = simulate(workload, policy)
    # Every request starts and ends when it did: the recorded order, the same
    # moments (ns), the same swaps. Run times do not depend on the neighbours
    # here (the fakes' do not), so the model is exact.
    assert result.order == recorded.order
    assert result.start_ns == recorded.start_ns
    assert result.end_ns == recorded.end_ns
    assert result.swaps == recorded.swaps


def _outcome(result: RunResult) -> tuple[object, ...]:
    return (
        result.order,
        result.start_ns,
        result.end_ns,
        result.swaps,
        result.swap_ns,
        result.busy_ns,
        dict(result.reorders),
    )


def test_one_group_of_every_model_is_the_one_lane_run_exactly() -> None:
    """The several-lane loop, on a router that allows one model at a time, decides
    as the one-lane loop does (film seed 1: 530 requests, 195 swaps); so such a
    run takes the one-lane loop, unless it records a log."""
    workload = film(1).workload
    one = Policy("one lane", ScoringParams(60 * S, 10))
    models = tuple(sorted({r.model for r in workload.requests}))
    lanes = replace(one, router=GroupRouter(groups=(Group(name="all", members=models),)))
    assert lanes.lanes and not one.lanes
    a = simulate(workload, one)
    with mock.patch.object(simulate_module, "one_at_a_time", lambda router, models: False):
        b = simulate(workload, lanes)  # the several-lane loop
    with mock.patch.object(simulate_module._Sim, "_run_lanes", side_effect=AssertionError):
        c = simulate(workload, lanes)  # the one-lane loop
    assert _outcome(a) == _outcome(b) == _outcome(c)
    recorded: list[ev.AnyEvent] = []
    assert _outcome(simulate(workload, lanes, record=recorded)) == _outcome(a)
    assert any(isinstance(e, ev.SwapStarted) and e.evicted for e in recorded)


@pytest.mark.parametrize("every_term", [False, True])
def test_skipping_futile_decisions_changes_nothing(every_term: bool) -> None:
    """The several-lane loop skips the decision after arrivals that cannot start
    (`policy.cannot_start`) when the last one found nothing; asking every time
    decides the same, on two GPU groups with four chat slots and on a matrix
    router, with every term on or not."""
    workload = film(1, days=3).workload
    params = ScoringParams(
        60 * S, 10, fair_share_bonus=10 * every_term, short_job_bonus=10 * every_term
    )
    two = GroupRouter(
        groups=(
            Group(name="gpu0", members=(CHAT,), exclusive=False),
            Group(name="gpu1", members=(IMAGE, VIDEO), exclusive=False),
        )
    )
    matrix = MatrixRouter(
        sets=(
            MatrixSet(name="a", models=frozenset({CHAT, IMAGE})),
            MatrixSet(name="b", models=frozenset({VIDEO})),
        )
    )
    for router, slots in ((two, ((CHAT, 4),)), (matrix, ((CHAT, 3), (IMAGE, 2)))):
        policy = Policy("p", params, router=router, slots=slots)
        skipping = simulate(workload, policy)
        with mock.patch.object(simulate_module, "cannot_start", lambda state, model: False):
            asking = simulate(workload, policy)
        assert _outcome(skipping) == _outcome(asking)


def test_slot_slowdown_stretches_a_request_that_starts_beside_others() -> None:
    t0 = 1_700_000_000 * S
    reqs = [Request(f"r{i}", "A", 0, t0 + i * S, 10 * S) for i in range(3)]
    workload = Workload(reqs, SwapTimes(), ScoringParams())
    base = Policy("p", ScoringParams(60 * S, 10), slots=(("A", 3),))
    free = simulate(workload, base)
    assert [e - s for s, e in zip(free.start_ns, free.end_ns, strict=True)] == [10 * S] * 3
    slowed = simulate(workload, replace(base, slot_slowdown=0.5))
    # the first alone, the second beside one, the third beside two
    runs = [e - s for s, e in zip(slowed.start_ns, slowed.end_ns, strict=True)]
    assert runs == [10 * S, 15 * S, 20 * S]
    # requests that start together (joining one load) are each beside the others
    together = replace(workload, requests=[replace(r, arrival_ns=t0) for r in reqs])
    slowed = simulate(together, replace(base, slot_slowdown=0.5))
    runs = [e - s for s, e in zip(slowed.start_ns, slowed.end_ns, strict=True)]
    assert runs == [20 * S] * 3


def test_a_config_must_name_every_model_of_the_log(tmp_path: Path) -> None:
    config = tmp_path / "other.yaml"
    config.write_text("models:\n  qwen-chat:\n    cmd: x --port ${PORT}\n")
    with pytest.raises(ResourcesError, match="flux-image, wan-video are not in it"):
        load_resources(str(config), ["flux-image", "qwen-chat", "wan-video"])
    both = load_resources(str(WHATIF / "film-both.yaml"), ["qwen-chat", "wan-video"])
    assert both.slots == (("qwen-chat", 4),) and isinstance(both.router, GroupRouter)


def test_replay_config_runs_the_film_with_a_second_gpu_beside_the_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "film.db"
    assert replay_command(["generate", "film", "--seed", "1", "--out", str(db)]) == 0
    capsys.readouterr()
    argv = [str(db), "--config", str(WHATIF / "film-second-gpu.yaml"), "--no-reference"]
    assert replay_command([*argv, "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["label"]: r for r in out["runs"]}
    assert set(runs) == {
        "recorded",
        "aging=60s bonus=10 (recorded)",
        "aging=60s bonus=10 on film-second-gpu.yaml",
    }
    assert out["simulation_error"]
    one, two = (
        runs["aging=60s bonus=10 (recorded)"],
        runs["aging=60s bonus=10 on film-second-gpu.yaml"],
    )
    # the chat requests no longer wait behind image and video work
    assert two["bands"]["normal"]["wait_p95_s"] < one["bands"]["normal"]["wait_p95_s"] / 10
    assert two["swaps"] < one["swaps"] / 5
