"""tools/replay: the simulation on the core, extraction, verify and figures, in memory."""

from __future__ import annotations

import msgspec
import pytest

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import FIFO
from tools.replay.generate import FilmSwapCost, film, generate_events
from tools.replay.report import figures
from tools.replay.simulate import Policy, shaken, simulate
from tools.replay.sweep import GridError, parse_grid
from tools.replay.verify import verify
from tools.replay.workload import Request, SwapTimes, Workload, extract_events

S = NS_PER_S
T0 = 1_700_000_000 * S


def req(
    rid: str, model: str, at_s: float, run_s: float, priority: int = 0, **kw: object
) -> Request:
    return Request(rid, model, priority, T0 + round(at_s * S), round(run_s * S), **kw)  # type: ignore[arg-type]


def workload(*requests: Request, load_s: float = 0.0, unload_s: float = 0.0) -> Workload:
    models = {r.model for r in requests}
    return Workload(
        requests=list(requests),
        swap_times=SwapTimes(
            load_ns=dict.fromkeys(models, round(load_s * S)),
            unload_ns=dict.fromkeys(models, round(unload_s * S)),
        ),
        params=ScoringParams(),
    )


def ids(w: Workload, order: list[int]) -> list[str]:
    return [w.requests[i].request_id for i in order]


# -- the order comes from the core --------------------------------------------------


@pytest.mark.parametrize(
    ("bonus", "expected"),
    [(10, ["long", "a2", "b", "c"]), (0, ["long", "b", "c", "a2"])],
)
def test_a_b_c_a_with_a_resident(bonus: int, expected: list[str]) -> None:
    w = workload(
        req("long", "A", 0, 100),
        req("b", "B", 1, 1),
        req("c", "C", 2, 1),
        req("a2", "A", 3, 1),
        load_s=5,
    )
    result = simulate(w, Policy("p", ScoringParams(60 * S, bonus)))
    assert ids(w, result.order) == expected


def test_aging_lets_a_batch_request_overtake_a_fresh_interactive_one() -> None:
    w = workload(
        req("long", "A", 0, 1000),
        req("batch", "A", 1, 1, priority=-100),
        req("inter", "A", 500, 1, priority=100),
    )
    # 1 point per second: after 999 s the batch request has aged past +100.
    aged = simulate(w, Policy("p", ScoringParams(1 * S, 0)))
    assert ids(w, aged.order) == ["long", "batch", "inter"]
    assert aged.reorders["aging"] == 1
    plain = simulate(w, Policy("p", ScoringParams(0, 0)))
    assert ids(w, plain.order) == ["long", "inter", "batch"]


def test_strict_arrival_order_ignores_priority_but_reports_bands() -> None:
    w = workload(req("long", "A", 0, 10), req("b", "A", 1, 1, -100), req("i", "A", 2, 1, 100))
    result = simulate(w, Policy("p", ScoringParams(0, 0), ignore_priority=True))
    assert ids(w, result.order) == ["long", "b", "i"]


def test_swaps_busy_and_idle_time_add_up() -> None:
    w = workload(req("a", "A", 0, 10), req("b", "B", 100, 20), load_s=3, unload_s=2)
    result = simulate(w, Policy("p"))
    # a: load A 3 s, run 10 s; idle; b: unload A 2 s + load B 3 s, run 20 s.
    assert result.swaps == 2
    assert result.swap_ns == 8 * S
    assert result.busy_ns == 38 * S
    assert result.last_ns - result.first_ns == 125 * S
    assert result.start_ns == [T0 + 3 * S, T0 + 105 * S]
    f = figures(w, result, label="x", kind="simulated", params=ScoringParams(), scheduler="serial")
    assert f["idle_s"] == 87.0
    # b is dispatched on arrival: its own swap is not wait (app/core/wait.py) ...
    assert f["bands"]["normal"]["wait_max_s"] == 0.0
    # ... but slowdown counts it: a (3 s + 10 s) / 10 s, b (5 s + 20 s) / 20 s.
    assert f["bands"]["normal"]["slowdown"] == 1.275


def test_a_client_that_gives_up_leaves_the_queue_at_its_patience() -> None:
    w = workload(
        req("long", "A", 0, 100),
        req("impatient", "A", 1, 1, patience_ns=10 * S),
        req("patient", "A", 2, 1),
    )
    result = simulate(w, Policy("p"))
    assert ids(w, result.order) == ["long", "patient"]
    f = figures(w, result, label="x", kind="simulated", params=ScoringParams(), scheduler="serial")
    assert f["bands"]["normal"]["left"] == 1


def test_a_chained_request_arrives_think_time_after_its_predecessor_ends() -> None:
    w = workload(
        req("blocker", "A", 0, 50),
        req("shot1", "A", 1, 10, -100),
        req("shot2", "A", 999, 10, -100, after=1, think_ns=2 * S),
    )
    result = simulate(w, Policy("p"))
    assert ids(w, result.order) == ["blocker", "shot1", "shot2"]
    # shot1 runs 50..60 s, so shot2 arrives at 62 s whatever its recorded time.
    assert result.arrival_ns[2] == T0 + 62 * S
    assert result.start_ns[2] == T0 + 62 * S


def test_fifo_shares_the_gpu_among_requests_in_flight() -> None:
    w = workload(req("a1", "A", 0, 10), req("a2", "A", 0, 10), req("b", "B", 1, 10))
    shared = simulate(w, Policy("f", ScoringParams(0, 0), scheduler=FIFO, concurrency=2))
    # a1 and a2 run together at half speed and end at 20 s; b waits for both.
    assert shared.start_ns[2] == T0 + 20 * S
    assert shared.last_ns == T0 + 30 * S
    one = simulate(w, Policy("f", ScoringParams(0, 0), scheduler=FIFO, concurrency=1))
    assert one.start_ns == [T0, T0 + 10 * S, T0 + 20 * S]


# -- generate -> log -> verify / extract ---------------------------------------------


@pytest.mark.parametrize(
    ("params", "scheduler"),
    [
        (ScoringParams(), "serial"),
        (ScoringParams(30 * S, 0), "serial"),
        (ScoringParams(0, 20), "serial"),
        (ScoringParams(0, 0), FIFO),
    ],
)
def test_a_generated_log_passes_verify(params: ScoringParams, scheduler: str) -> None:
    events = generate_events(film(3), params, scheduler)
    result = verify(enumerate(events, 1))
    assert result.ok, result.divergence and result.divergence.describe()
    assert result.decisions > 400
    ats = [e.at for e in events]
    assert ats == sorted(ats)


def test_verify_reports_the_first_dispatch_that_contradicts_the_score() -> None:
    events = generate_events(film(3), ScoringParams())
    decisions = [i for i, e in enumerate(events) if isinstance(e, ev.ScoresComputed)]
    # Find a decision with a runner-up and make the runner-up the recorded winner.
    k = next(i for i in decisions if getattr(events[i], "runner_up_id", None))
    scores = events[k]
    assert isinstance(scores, ev.ScoresComputed) and scores.runner_up_id is not None
    events[k] = msgspec.structs.replace(scores, request_id=scores.runner_up_id)
    result = verify(enumerate(events, 1))
    assert result.divergence is not None
    assert result.divergence.seq == k + 1
    text = result.divergence.describe()
    assert scores.runner_up_id in text and scores.request_id in text
    assert "priority" in text and "aging" in text


def test_extracting_a_generated_log_gives_back_its_workload_and_order() -> None:
    scenario = film(5)
    params = ScoringParams()
    events = generate_events(scenario, params)
    w = extract_events(enumerate(events, 1))
    assert w.params == params
    assert len(w.requests) == len(scenario.workload.requests)
    render = [r for r in w.requests if r.caller == "render"]
    assert len(render) == 174
    assert [r.after >= 0 for r in render] == [False] + [True] * 173  # one chain
    # Two users each send a request within 5 s of their previous one's end on this
    # seed, by chance: a chain of two is no chain (issue 22).
    assert {r.caller for r in w.requests if r.after >= 0} == {"render"}
    recorded = w.recorded
    assert recorded is not None
    # Same swap costs in the same order: the re-run reproduces the recorded dispatches.
    again = simulate(w, Policy("again", params), swap_cost=FilmSwapCost(5))
    assert ids(w, again.order) == ids(w, recorded.order)
    assert again.swaps == recorded.swaps
    assert again.start_ns == recorded.start_ns


# -- figures, shake, grid ---------------------------------------------------------------


def test_percentiles_and_bounded_slowdown() -> None:
    w = workload(*(req(f"r{i}", "A", 0, 1) for i in range(1, 21)))
    result = simulate(w, Policy("p", ScoringParams(0, 0)))
    f = figures(w, result, label="x", kind="simulated", params=None, scheduler="serial")
    band = f["bands"]["normal"]
    # Waits are 0, 1, ..., 19 s (nearest rank).
    assert (band["wait_p50_s"], band["wait_p95_s"], band["wait_max_s"]) == (9.0, 18.0, 19.0)
    # (wait + 1 s) / 10 s on average: (0.1 + ... + 2.0) / 20
    assert band["slowdown"] == pytest.approx(1.05)


def test_shake_is_seeded() -> None:
    w = film(2).workload
    a, b, c = shaken(w, 1, 0.05), shaken(w, 1, 0.05), shaken(w, 2, 0.05)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_shake_draws_again_what_the_replay_estimated() -> None:
    """A request that never ran gets the run time of a random completed one of its
    model and band; each swap takes a measured time of its model, seeded."""
    ran = [Request(f"r{i}", "A", 0, T0 + i * S, (i + 1) * S) for i in range(5)]
    unrun = Request("gone", "A", 0, T0 + 9 * S, 3 * S, run_estimated=True, outcome="cancelled")
    w = Workload(requests=[*ran, unrun], swap_times=SwapTimes(), params=ScoringParams())
    draws = {shaken(w, seed, 0.0).requests[-1].run_ns for seed in range(40)}
    assert draws <= {r.run_ns for r in ran} and len(draws) > 1
    assert [r.run_ns for r in shaken(w, 3, 0.0).requests[:5]] == [r.run_ns for r in ran]
    times = SwapTimes(
        load_ns={"A": 20 * S},
        load_samples={"A": (10 * S, 20 * S, 60 * S)},
        unload_samples={"A": (2 * S,)},
    )
    cost = times.sampler(1)
    loads = [cost("A", "A") for _ in range(30)]
    assert {load for _, load in loads} == {10 * S, 20 * S, 60 * S}
    assert {unload for unload, _ in loads} == {2 * S}
    assert cost(None, "B")[0] == 0 and cost(None, "B")[1] in {10 * S, 20 * S, 60 * S}
    again = times.sampler(1)
    assert [again("A", "A") for _ in range(30)] == loads  # seeded


def test_sweep_grid() -> None:
    base = ScoringParams(60 * S, 10)
    grid = parse_grid(["aging=0,0.5,120", "bonus=0,20"], base)
    assert len(grid) == 6
    assert ScoringParams(S // 2, 20) in grid
    assert parse_grid(["bonus=5"], base) == [ScoringParams(60 * S, 5)]
    for bad in (["bonus=100"], ["aging=-1"], ["aging=x"], ["speed=1"], ["bonus=1", "bonus=2"]):
        with pytest.raises(GridError):
            parse_grid(bad, base)


def test_verify_starts_a_fresh_state_with_each_server_started_and_its_parameters() -> None:
    day = 86_400 * S
    first = generate_events(film(3), ScoringParams(60 * S, 10))
    second = [
        msgspec.structs.replace(e, at=e.at + day)
        for e in generate_events(film(4), ScoringParams(30 * S, 0))
    ]
    log = list(enumerate([*first, *second], 1))
    result = verify(log)
    assert result.ok, result.divergence and result.divergence.describe()
    # The second session's decisions need its own parameters: with the first
    # session's (bonus 10 instead of 0) some decision comes out differently.
    started = second[0]
    assert isinstance(started, ev.ServerStarted)
    wrong = msgspec.structs.replace(started, aging_divisor_ns=60 * S, swap_affinity_bonus=10)
    tampered = list(enumerate([*first, wrong, *second[1:]], 1))
    divergence = verify(tampered).divergence
    assert divergence is not None and divergence.seq > len(first)
    w = extract_events(log)
    assert w.params == ScoringParams(30 * S, 0)  # the parameters in force at the end


@pytest.mark.parametrize("scheduler", ["serial", FIFO])
def test_a_what_if_run_dispatches_exactly_as_a_recorded_one(scheduler: str) -> None:
    # Unrecorded runs use `choose` (no scores built); recorded ones `decide`.
    every_term = ScoringParams(60 * S, 10, fair_share_bonus=10, short_job_bonus=10)
    work = film(2).workload
    policy = Policy("every term", every_term, scheduler=scheduler, concurrency=2)
    unrecorded = simulate(work, policy)
    recorded = simulate(work, policy, record=[])
    assert unrecorded.order == recorded.order
    assert unrecorded.start_ns == recorded.start_ns
    assert unrecorded.reorders == recorded.reorders
    assert len(unrecorded.order) > 400
    if scheduler == "serial":
        assert all(unrecorded.reorders[r] > 0 for r in ("aging", "fair_share", "short_job"))
