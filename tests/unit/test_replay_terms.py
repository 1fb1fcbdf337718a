"""tools/replay and the new score terms: the sweep axes, what the simulation tells the
core (server_started, enqueues), and that the terms change what a run does."""

from __future__ import annotations

import msgspec
import pytest

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.generate import fair, film, generate_events
from tools.replay.report import figures
from tools.replay.simulate import Policy, simulate, started_event
from tools.replay.sweep import GridError, label_of, parse_grid
from tools.replay.verify import verify
from tools.replay.workload import Request, SwapTimes, Workload, extract_events

S = NS_PER_S
T0 = 1_700_000_000 * S


def req(rid: str, at_s: float, run_s: float, **kw: object) -> Request:
    return Request(rid, "A", 0, T0 + round(at_s * S), round(run_s * S), **kw)  # type: ignore[arg-type]


def workload(*requests: Request) -> Workload:
    return Workload(requests=list(requests), swap_times=SwapTimes(), params=ScoringParams())


def enqueues(events: list[ev.AnyEvent]) -> dict[str, ev.RequestEnqueued]:
    return {e.request_id: e for e in events if isinstance(e, ev.RequestEnqueued)}


# -- the axes --------------------------------------------------------------------------


def test_the_grid_sweeps_fair_share_and_short_job_points() -> None:
    grid = parse_grid(["fair=0,10,20", "short=0,10"], ScoringParams(60 * S, 10))
    assert len(grid) == 6
    assert ScoringParams(60 * S, 10, fair_share_bonus=20, short_job_bonus=10) in grid
    assert label_of(grid[-1]) == "aging=60s bonus=10 fair=20 short=10"
    assert label_of(ScoringParams(60 * S, 10)) == "aging=60s bonus=10"  # terms off: as before


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["fair=100"], "fair 100: must be 0..99"),
        (["short=x"], "not an integer short"),
        (["bonus=40", "fair=30", "short=30"], "shortJobBonus 30 \\+ tierSpan 2 = 102 could lift"),
        (["fair=1", "fair=2"], "fair is given twice"),
    ],
)
def test_a_grid_that_could_cross_a_band_is_refused(specs: list[str], message: str) -> None:
    with pytest.raises(GridError, match=message):
        parse_grid(specs, ScoringParams())


# -- what the core is told ------------------------------------------------------------


def test_server_started_carries_the_policys_terms_and_caller_weights() -> None:
    policy = Policy(
        "p",
        ScoringParams(30 * S, 5, fair_share_bonus=20, short_job_bonus=10),
        caller_weights=(("member-a", 1), ("member-b", 3)),
    )
    started = started_event(policy, ["A"], T0)
    assert (started.fair_share_bonus, started.short_job_bonus) == (20, 10)
    assert started.caller_weights == {"member-a": 1, "member-b": 3}
    record: list[ev.AnyEvent] = []
    simulate(workload(req("a", 0, 1)), policy, record=record)
    assert record[0] == msgspec.structs.replace(started, at=record[0].at)


def test_without_recorded_estimates_an_enqueue_carries_what_the_runs_so_far_teach() -> None:
    # As the live server: the median of the completed runs of the model and endpoint.
    w = workload(
        req("first", 0, 10, caller="u"),
        req("second", 1, 30, caller="u"),
        req("third", 50, 1, caller="v"),
        req("other-endpoint", 50, 1, endpoint="/v1/images/generations"),
    )
    record: list[ev.AnyEvent] = []
    simulate(w, Policy("p"), record=record)
    seen = enqueues(record)
    assert seen["first"].expected_run_ns is None  # no history yet
    assert seen["second"].expected_run_ns is None  # "first" is still running
    assert seen["third"].expected_run_ns == 10 * S  # lower median of 10 s and 30 s
    assert seen["other-endpoint"].expected_run_ns is None
    assert (seen["first"].caller, seen["third"].caller) == ("u", "v")


def test_recorded_estimates_are_used_as_recorded() -> None:
    w = workload(req("a", 0, 10, expected_run_ns=7 * S), req("b", 1, 10))
    record: list[ev.AnyEvent] = []
    simulate(w, Policy("p"), record=record)
    seen = enqueues(record)
    assert seen["a"].expected_run_ns == 7 * S
    assert seen["b"].expected_run_ns is None  # the log had no history for it: none here


# -- the terms at work (the core's) ---------------------------------------------------------


def test_the_short_job_term_lets_a_short_request_pass_a_long_one_of_its_band() -> None:
    w = workload(
        req("running", 0, 100, expected_run_ns=100 * S),
        # one term per model and endpoint (log format 3): a render is another endpoint
        req("render", 1, 600, expected_run_ns=600 * S, endpoint="/v1/images/generations"),
        req("chat", 2, 5, expected_run_ns=5 * S),
    )
    plain = simulate(w, Policy("p", ScoringParams(60 * S, 10)))
    short = simulate(w, Policy("p", ScoringParams(60 * S, 10, short_job_bonus=20)))
    order = [[w.requests[i].request_id for i in r.order] for r in (plain, short)]
    assert order == [["running", "render", "chat"], ["running", "chat", "render"]]
    assert short.reorders["short_job"] == 1


def test_the_fair_share_term_serves_the_second_caller_within_minutes() -> None:
    scenario = fair(1)
    w = scenario.workload
    rows = {}
    for points in (0, 20):
        params = ScoringParams(60 * S, 10, fair_share_bonus=points)
        result = simulate(w, Policy("p", params), swap_cost=scenario.swap_cost)
        rows[points] = figures(
            w, result, label="p", kind="simulated", params=params, scheduler="serial"
        )
    b_off, b_on = rows[0]["callers"]["member-b"], rows[20]["callers"]["member-b"]
    # Arrival order: B waits behind A's 200 shots of 3-5 min; fair share: about one shot.
    assert b_off["first_start_s"] > 12 * 3600
    assert b_on["first_start_s"] < 10 * 60
    assert b_on["last_finish_s"] < 4 * 3600 < b_off["last_finish_s"]
    a_off, a_on = rows[0]["callers"]["member-a"], rows[20]["callers"]["member-a"]
    assert a_on["last_finish_s"] > a_off["last_finish_s"]  # paid for by A
    assert rows[20]["reorders"]["fair_share"] >= 19
    assert rows[0]["bands"]["batch"]["fairness"] != rows[20]["bands"]["batch"]["fairness"]


def test_a_generated_fair_log_with_fair_share_on_verifies_and_records_the_callers() -> None:
    params = ScoringParams(60 * S, 10, fair_share_bonus=20)
    events = generate_events(fair(2), params, label="fair")
    result = verify(enumerate(events, 1))
    assert result.ok, result.divergence and result.divergence.describe()
    assert result.decisions == 220
    seen = list(enqueues(events).values())
    assert {e.caller for e in seen} == {"member-a", "member-b"}
    assert all(e.durable for e in seen)
    assert extract_events(enumerate(events, 1)).params == params


def test_a_generated_film_log_with_every_term_on_verifies_and_records_estimates() -> None:
    params = ScoringParams(60 * S, 10, fair_share_bonus=10, short_job_bonus=20)
    events = generate_events(film(3), params)
    result = verify(enumerate(events, 1))
    assert result.ok, result.divergence and result.divergence.describe()
    seen = list(enqueues(events).values())
    chats = [e.expected_run_ns for e in seen if e.model == "qwen-chat" and e.priority >= 50]
    learnt = [x for x in chats if x is not None]
    assert len(learnt) > len(chats) - 5  # but the first few, before any chat completed
    assert all(S <= x <= 60 * S for x in learnt)
    w = extract_events(enumerate(events, 1))
    assert w.params == params and w.expected_recorded
    # Re-run from the log, the recorded estimates are used as they are.
    record: list[ev.AnyEvent] = []
    simulate(w, Policy("again", params), record=record)
    again = enqueues(record)
    assert all(again[e.request_id].expected_run_ns == e.expected_run_ns for e in seen)
