"""tools/replay: clients who give up in what-if runs (tools/replay/patience.py)."""

from __future__ import annotations

import pytest

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.patience import (
    NONE,
    PatienceError,
    PatienceModel,
    Survival,
    describe,
    draw,
    estimates,
    kaplan_meier,
    parse_patience,
    summary,
    with_patience,
)
from tools.replay.report import figures
from tools.replay.simulate import Policy, simulate
from tools.replay.workload import Request, SwapTimes, Workload, extract_events

S = NS_PER_S
MIN = 60 * S
T0 = 1_700_000_000 * S


def req(rid: str, at_s: float, run_s: float, priority: int = 100, **kw: object) -> Request:
    return Request(rid, "A", priority, T0 + round(at_s * S), round(run_s * S), **kw)  # type: ignore[arg-type]


def workload(*requests: Request) -> Workload:
    return Workload(requests=list(requests), swap_times=SwapTimes(), params=ScoringParams())


def left(w: Workload, policy: Policy) -> list[str]:
    result = simulate(w, policy)
    return [r.request_id for r, t in zip(w.requests, result.start_ns, strict=True) if t < 0]


def test_patience_arguments() -> None:
    assert parse_patience("auto") == PatienceModel()
    assert parse_patience("none") == NONE
    stated = parse_patience("interactive=10m, normal=1.5h,batch=none")
    assert stated.stated == {"interactive": 10 * MIN, "normal": 90 * MIN, "batch": None}
    assert parse_patience("normal=90").stated == {"normal": 90 * S}
    for bad in (
        "sometimes",
        "vip=10m",
        "interactive=-1m",
        "interactive=soon",
        "normal=1m,normal=2m",
    ):
        with pytest.raises(PatienceError):
            parse_patience(bad)


def recorded_log() -> list[ev.AnyEvent]:
    """One long job, then: a client who leaves after 10 min, one who leaves after
    30 min, one served after 40 min, a batch request served after 45 min and one
    cancelled by its deadline, as the live server would have logged them."""
    t = T0
    log: list[ev.AnyEvent] = [
        ev.ServerStarted(
            at=t,
            version="",
            config_hash="",
            scheduler="serial",
            aging_divisor_ns=60 * S,
            swap_affinity_bonus=10,
        )
    ]

    def enqueue(rid: str, at: int, priority: int = 100, **kw: object) -> None:
        log.append(
            ev.RequestEnqueued(
                at=at,
                request_id=rid,
                model="A",
                model_requested="A",
                endpoint="/v1/chat/completions",
                priority=priority,
                band="interactive" if priority >= 50 else "batch",
                **kw,  # type: ignore[arg-type]
            )
        )

    def run(rid: str, at: int, took: int) -> None:
        log.append(ev.RequestDispatched(at=at, request_id=rid, model="A"))
        log.append(ev.RequestStarted(at=at, request_id=rid))
        log.append(ev.RequestCompleted(at=at + took, request_id=rid, http_status=200))

    enqueue("long", t)
    enqueue("quick-to-leave", t + S)
    enqueue("slow-to-leave", t + S)
    enqueue("served", t + 2 * S)
    enqueue("batch", t + 3 * S, priority=-100)
    enqueue("deadline", t + 3 * S, priority=-100, max_wait_ns=5 * MIN)
    run("long", t, 40 * MIN)
    log.append(
        ev.RequestCancelled(at=t + S + 10 * MIN, request_id="quick-to-leave", reason="client_gone")
    )
    log.append(
        ev.RequestCancelled(at=t + 3 * S + 5 * MIN, request_id="deadline", reason="deadline")
    )
    log.append(
        ev.RequestCancelled(at=t + S + 30 * MIN, request_id="slow-to-leave", reason="client_gone")
    )
    run("served", t + 40 * MIN, MIN)
    run("batch", t + 41 * MIN, MIN)
    return sorted(log, key=lambda e: e.at)


def test_extraction_keeps_who_left_how_and_how_long_the_others_waited() -> None:
    w = extract_events(enumerate(recorded_log(), 1))
    by_id = {r.request_id: r for r in w.requests}
    assert by_id["quick-to-leave"].patience_ns == 10 * MIN
    assert by_id["quick-to-leave"].left_by == "client_gone"
    assert by_id["deadline"].left_by == "deadline"
    assert by_id["deadline"].max_wait_ns == 5 * MIN
    assert by_id["served"].patience_ns is None
    assert by_id["served"].waited_ns == 40 * MIN - 2 * S
    # Leavers are events, the served and the deadline's are censored (a deadline is not
    # a client's patience); "long" was dispatched at once: censored at 0.
    curves = estimates(w)
    assert list(curves) == [("interactive", "A"), ("batch", "A")]
    chat = curves[("interactive", "A")]
    assert (chat.leavers, chat.censored) == (2, 2)
    assert chat.times == (10 * MIN, 30 * MIN)
    assert chat.survival == pytest.approx((2 / 3, 1 / 3))  # 3 at risk at 10m, 2 at 30m
    assert chat.median_ns == 30 * MIN
    batch = curves[("batch", "A")]
    assert (batch.leavers, batch.censored, batch.times) == (0, 2, ())


def test_a_served_client_draws_from_its_curve_past_what_it_waited() -> None:
    recorded = extract_events(enumerate(recorded_log(), 1))
    w = with_patience(recorded, PatienceModel())
    by_id = {r.request_id: r for r in w.requests}
    # It waited 40 min and stayed; nobody was seen to leave later: it stays.
    assert by_id["served"].patience_ns is None
    curve = estimates(recorded)[("interactive", "A")]
    assert by_id["long"].patience_ns == curve.quantile(draw("long"))  # dispatched at once
    assert by_id["batch"].patience_ns is None  # no batch client ever left
    assert with_patience(recorded, PatienceModel()).requests == w.requests  # deterministic
    # A stated band: that patience, never less than the recorded wait.
    stated = with_patience(recorded, parse_patience("interactive=10m"))
    assert {r.request_id: r.patience_ns for r in stated.requests}["served"] == 40 * MIN - 2 * S + 1


def test_in_a_what_if_run_a_slower_policy_loses_the_clients_the_model_says() -> None:
    w = workload(
        req("long", 0, 20 * 60),
        req("impatient", 1, 10, patience_ns=10 * MIN, left_by="client_gone"),
        req("chat", 2, 5, waited_ns=30),
        req("job", 3, 5, durable=True),
        req("deadline", 4, 5, max_wait_ns=15 * MIN),
    )
    assert left(w, Policy("p")) == ["impatient", "deadline"]  # the others wait forever
    modelled = with_patience(w, PatienceModel())
    # "chat" gets the band's 10 min; the durable job never leaves; the deadline holds.
    assert left(modelled, Policy("p")) == ["impatient", "chat", "deadline"]
    stated = with_patience(w, parse_patience("interactive=30m"))
    assert left(stated, Policy("p")) == ["impatient", "deadline"]
    record: list[ev.AnyEvent] = []
    result = simulate(modelled, Policy("p"), record=record)
    reasons = {e.request_id: e.reason for e in record if isinstance(e, ev.RequestCancelled)}
    assert reasons == {"impatient": "client_gone", "chat": "client_gone", "deadline": "deadline"}
    f = figures(modelled, result, label="x", kind="simulated", params=None, scheduler="serial")
    assert f["bands"]["interactive"]["left"] == 3


def test_with_the_recorded_parameters_the_served_clients_stay() -> None:
    w = extract_events(enumerate(recorded_log(), 1))
    modelled = with_patience(w, PatienceModel())
    assert left(modelled, Policy("p", w.params)) == ["quick-to-leave", "slow-to-leave", "deadline"]


def test_kaplan_meier_of_a_small_censored_sample_by_hand() -> None:
    """Minutes: left at 2, 4, 4, 6; censored (served) at 3, 4, 8. At 2: 7 at risk,
    S = 6/7; at 4: 5 at risk (the one censored at 4 counts), S = 6/7 x 3/5 = 18/35;
    at 6: 2 at risk, S = 18/35 x 1/2 = 9/35; after 8 the curve says nothing."""
    sample = [(2, True), (3, False), (4, True), (4, True), (4, False), (6, True), (8, False)]
    curve = kaplan_meier([(t * MIN, left) for t, left in sample])
    assert curve.times == (2 * MIN, 4 * MIN, 6 * MIN)
    assert curve.survival == pytest.approx((6 / 7, 18 / 35, 9 / 35))
    assert (curve.leavers, curve.censored, curve.longest_ns) == (4, 3, 8 * MIN)
    assert curve.at(MIN) == 1.0 and curve.at(5 * MIN) == pytest.approx(18 / 35)
    assert curve.median_ns == 6 * MIN  # 18/35 > 1/2 >= 9/35
    # Conditioned on having waited 3 min (S = 6/7): S(t) / (6/7) <= u.
    assert curve.quantile(0.7, 3 * MIN) == 4 * MIN  # 0.7 x 6/7 = 0.6 >= 18/35
    assert curve.quantile(0.5, 3 * MIN) == 6 * MIN  # 3/7 < 18/35, 9/35 <= 3/7
    assert curve.quantile(0.2, 3 * MIN) is None  # the curve ends at 9/35 > 6/35: stays
    # Waited 4 min exactly: the next leaving time is 6 min, never 4.
    assert curve.quantile(0.99, 4 * MIN) == 6 * MIN
    assert kaplan_meier([]) == Survival()


def test_one_models_leavers_are_never_lent_to_anothers_clients() -> None:
    chats = [
        req(f"c{i}", i, 5, patience_ns=(10 + i) * MIN, left_by="client_gone") for i in range(5)
    ]
    images = [
        Request(f"i{i}", "B", 100, T0 + i * S, 600 * S, waited_ns=(20 + i) * MIN, caller="x")
        for i in range(3)
    ]
    never = Request("n", "B", 100, T0, 600 * S)  # never dispatched: no observation
    batch = req("b", 9, 5, priority=-100, waited_ns=0)
    w = with_patience(workload(*chats, *images, never, batch), PatienceModel())
    by_id = {r.request_id: r.patience_ns for r in w.requests}
    # Model B's clients never left: they stay, whatever A's clients did.
    assert [by_id[f"i{i}"] for i in range(3)] + [by_id["n"], by_id["b"]] == [None] * 5
    # ... and so does the batch band of model A (no batch leaver).
    rows = {(r["band"], r["model"]): r for r in summary(w, PatienceModel())}
    assert rows[("interactive", "A")] == {
        "band": "interactive",
        "model": "A",
        "leavers": 5,
        "censored": 0,
        "longest_s": 840.0,
        "estimate": "kaplan-meier",
        "median_s": 720.0,
    }
    assert rows[("interactive", "B")]["estimate"] == "stays"
    assert rows[("interactive", "B")]["censored"] == 3
    text = describe(w, PatienceModel())
    assert "interactive A: Kaplan-Meier, median 12m00s (5 leavers, 0 censored)" in text
    assert "interactive B: stays (no leavers: never leaves within the 22m00s observed)" in text
    assert "(0 leavers, 3 censored)" in text
    assert describe(w, NONE) == "none (served clients never leave)"


def test_draws_are_seeded_and_spread() -> None:
    us = [draw(f"r{i}") for i in range(1000)]
    assert all(0 < u < 1 for u in us) and us == [draw(f"r{i}") for i in range(1000)]
    assert 0.45 < sorted(us)[500] < 0.55
    assert draw("r1", seed=1) != draw("r1")


def test_a_shaken_copy_draws_the_served_clients_patience_again() -> None:
    """`--shake`: each copy redraws what the patience model drew, with its own seed;
    the recorded leavers keep theirs, and a drawn patience is no observation."""
    recorded = extract_events(enumerate(recorded_log(), 1))
    w = with_patience(recorded, PatienceModel())
    again = with_patience(w, PatienceModel(), seed=7)
    assert estimates(w) == estimates(recorded) == estimates(again)
    by_id = {r.request_id: r for r in again.requests}
    assert by_id["long"].patience_drawn
    curve = estimates(recorded)[("interactive", "A")]
    assert by_id["long"].patience_ns == curve.quantile(draw("long", seed=7))
    for r, r2 in zip(w.requests, again.requests, strict=True):
        if not r.patience_drawn:
            assert r2.patience_ns == r.patience_ns  # recorded leavers, deadlines, stays
    assert with_patience(again, PatienceModel()).requests == w.requests  # seed 0 again
