"""tools/replay: clients who give up in what-if runs (tools/replay/patience.py)."""

from __future__ import annotations

import pytest

from app.core import events as ev
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.patience import (
    NONE,
    PatienceError,
    PatienceModel,
    band_patience,
    parse_patience,
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
    # The band's patience is its leavers' median; a deadline is not a client's patience.
    assert band_patience(w, PatienceModel()) == {
        "interactive": 10 * MIN,
        "normal": None,
        "batch": None,
    }


def test_a_served_client_waits_its_bands_patience_but_never_less_than_it_did() -> None:
    w = with_patience(extract_events(enumerate(recorded_log(), 1)), PatienceModel())
    by_id = {r.request_id: r for r in w.requests}
    # It waited 40 min and stayed, so the band's 10 min is too little for it.
    assert by_id["served"].patience_ns == 40 * MIN - 2 * S + 1
    assert by_id["long"].patience_ns == 10 * MIN  # dispatched at once: the band's
    assert by_id["batch"].patience_ns is None  # no batch client ever left


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
