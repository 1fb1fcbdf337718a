"""Identical requests keep arrival order under every term (issue 22, item 4).

Identical: the same model, endpoint, priority and caller. Each request's expected
run time is drawn from an estimate that drifts as runs complete, as
`RunEstimates` does. Up to log format 2 the short-job term was fixed per request
from the estimate at its enqueue, so a later request could get more points than an
earlier identical one and overtake it (for ever with `agingDivisor: 0`); from
format 3 it is one term per (model, endpoint) from the current estimate, so it
cannot. Traces run through the real core (`apply`, `decide`) on one serial lane.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core import events as ev
from app.core.policy import decide
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from app.core.state import SchedulerState, apply
from tools.replay.verify import verify

T0 = 1_700_000_000 * NS_PER_S
CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"


class Arrival(msgspec.Struct, frozen=True):
    request_id: str
    at: int
    model: str
    endpoint: str
    priority: int
    caller: str | None
    expected_run_ns: int | None
    run_ns: int
    """How long it really runs once dispatched."""

    @property
    def identity(self) -> tuple[str, str, int, str | None]:
        return (self.model, self.endpoint, self.priority, self.caller)


def run_trace(
    arrivals: Sequence[Arrival], params: ScoringParams, log_format: int, swap_ns: int = 0
) -> tuple[list[str], dict[str, int], list[ev.AnyEvent]]:
    """Serve `arrivals` (sorted by time) on one serial lane: the dispatch order, each
    request's dispatch time and the log."""
    state = SchedulerState()
    log: list[ev.AnyEvent] = []

    def fold(event: ev.AnyEvent) -> None:
        apply(state, event)
        log.append(event)

    fold(
        ev.ServerStarted(
            at=T0,
            version="test",
            config_hash="",
            scheduler="serial",
            aging_divisor_ns=params.aging_divisor_ns,
            swap_affinity_bonus=params.swap_affinity_bonus,
            fair_share_bonus=params.fair_share_bonus,
            short_job_bonus=params.short_job_bonus,
            log_format=log_format,
        )
    )
    order: list[str] = []
    started: dict[str, int] = {}
    by_id = {a.request_id: a for a in arrivals}
    busy: tuple[int, str] | None = None  # (ends at, request id)
    i = 0
    now = T0
    while i < len(arrivals) or busy is not None:
        if busy is not None and (i == len(arrivals) or busy[0] <= arrivals[i].at):
            now, rid = busy
            fold(ev.RequestCompleted(at=now, request_id=rid, http_status=200))
            busy = None
        else:
            a = arrivals[i]
            i += 1
            now = a.at
            fold(
                ev.RequestEnqueued(
                    at=now,
                    request_id=a.request_id,
                    model=a.model,
                    model_requested=a.model,
                    endpoint=a.endpoint,
                    priority=a.priority,
                    band=band_of(a.priority),
                    caller=a.caller,
                    expected_run_ns=a.expected_run_ns,
                )
            )
        if busy is None:
            decision = decide(state, now)
            if decision is None:
                continue
            for event in decision.events:
                fold(event)
            rid = decision.dispatched.request_id
            order.append(rid)
            started[rid] = now
            end = now
            model = decision.dispatched.model
            if decision.dispatched.swap:
                fold(ev.SwapStarted(at=now, from_model=state.resident, to_model=model))
                end += swap_ns
                fold(ev.SwapFinished(at=end, model=model, duration_ms=swap_ns / 1e6))
            busy = (end + by_id[rid].run_ns, rid)
    return order, started, log


def overtaken(arrivals: Sequence[Arrival], order: Sequence[str]) -> list[tuple[str, str]]:
    """(earlier, later) pairs of identical requests dispatched out of arrival order."""
    place = {rid: n for n, rid in enumerate(order)}
    out = []
    for n, a in enumerate(arrivals):
        for b in arrivals[n + 1 :]:
            if a.identity == b.identity and place[b.request_id] < place[a.request_id]:
                out.append((a.request_id, b.request_id))
    return out


def chats_with_a_falling_estimate() -> list[Arrival]:
    """The issue's adversarial case, small: one long render holds the lane; a chat
    arrives while the learnt median chat is slow (60 s), then the median falls to
    6 s and a chat arrives every 5 s for two hours, each running 6 s, so there is
    always a newer chat waiting."""
    arrivals = [
        Arrival("render", T0, "m", "/v1/images/generations", 0, None, None, 600 * NS_PER_S),
        Arrival("first", T0 + NS_PER_S, "m", CHAT, 0, None, 60 * NS_PER_S, 6 * NS_PER_S),
    ]
    for n in range(2 * 3600 // 5):
        at = T0 + 2 * NS_PER_S + n * 5 * NS_PER_S
        arrivals.append(Arrival(f"c{n}", at, "m", CHAT, 0, None, 6 * NS_PER_S, 6 * NS_PER_S))
    return arrivals


SHORT_ONLY = ScoringParams(aging_divisor_ns=0, swap_affinity_bonus=0, short_job_bonus=20)


def test_a_drifting_estimate_reordered_identical_chats_before_format_3() -> None:
    arrivals = chats_with_a_falling_estimate()
    order, started, _ = run_trace(arrivals, SHORT_ONLY, log_format=2)
    # The first chat got 20 x 60/120 = 10 points, every later one 20 x 60/66 = 18.18:
    # it waits until the stream of newer identical chats dries up.
    assert order[-1] == "first"
    assert started["first"] - T0 > 2 * 3600 * NS_PER_S
    assert len(overtaken(arrivals, order)) == len(arrivals) - 2


def test_identical_chats_keep_arrival_order_from_format_3() -> None:
    arrivals = chats_with_a_falling_estimate()
    order, started, _ = run_trace(arrivals, SHORT_ONLY, log_format=ev.LOG_FORMAT)
    assert order[:2] == ["render", "first"]
    assert started["first"] == T0 + 600 * NS_PER_S
    assert overtaken(arrivals, order) == []


def test_the_term_still_favours_the_shorter_endpoint() -> None:
    """Per (model, endpoint): an embedding (6 s) still goes before a render of the
    same model that arrived earlier (4 min), and the term uses the latest estimate."""
    arrivals = [
        Arrival("busy", T0, "m", CHAT, 0, None, None, 60 * NS_PER_S),
        Arrival("render", T0 + 1, "m", "/v1/images/generations", 0, None, 240 * NS_PER_S, 1),
        Arrival("embed", T0 + 2, "m", EMBED, 0, None, 6 * NS_PER_S, 1),
    ]
    order, _, log = run_trace(arrivals, SHORT_ONLY, log_format=ev.LOG_FORMAT)
    assert order == ["busy", "embed", "render"]
    scores = [e for e in log if isinstance(e, ev.ScoresComputed)]
    # 20 x 60/66 in whole points (the key's unit with agingDivisor 0)
    assert scores[1].winner.short_job == SHORT_ONLY.short_job_key(6 * NS_PER_S) == 18
    assert scores[1].without_short_job_id == "render"


def test_a_later_estimate_rescores_every_waiting_request_of_its_pair() -> None:
    """Format 3: the term of a waiting request follows the estimate its model and
    endpoint had at the latest enqueue, not the one it had at its own."""
    arrivals = [
        Arrival("busy", T0, "m", CHAT, 0, None, None, 60 * NS_PER_S),
        Arrival("chat1", T0 + 1, "m", CHAT, 0, None, 6 * NS_PER_S, 1),
        Arrival("render", T0 + 2, "m", "/v1/images/generations", 0, None, 60 * NS_PER_S, 1),
        # chats now take 16 min: the waiting chat1 is scored with that
        Arrival("chat2", T0 + 3, "m", CHAT, 0, None, 960 * NS_PER_S, 1),
    ]
    order, _, _ = run_trace(arrivals, SHORT_ONLY, log_format=ev.LOG_FORMAT)
    assert order == ["busy", "render", "chat1", "chat2"]
    old_order, _, _ = run_trace(arrivals, SHORT_ONLY, log_format=2)
    assert old_order == ["busy", "chat1", "render", "chat2"]


@pytest.mark.parametrize("log_format", [1, 2, ev.LOG_FORMAT])
def test_logs_of_every_format_verify_as_they_were_decided(log_format: int) -> None:
    """`replay --verify` folds each log by the format it records: a format-2 log
    (short-job term per request) still verifies, reorder and all."""
    arrivals = chats_with_a_falling_estimate()[:200]
    order, _, log = run_trace(arrivals, SHORT_ONLY, log_format)
    result = verify(enumerate(log, 1))
    assert result.ok, result.divergence
    assert result.decisions == len(arrivals)
    assert (order[-1] == "first") == (log_format < 3)


# -- the property ------------------------------------------------------------

MODELS = ["m0", "m1"]
ENDPOINTS = [CHAT, EMBED]
CALLERS = [None, "a", "b"]
PRIORITIES = [100, 1, 0, -100]
FACTORS = [1, 1, 1, 2, 3, 10, 1 / 2, 1 / 3, 1 / 10]
"""How the estimate of a (model, endpoint) may move between two of its arrivals."""


@st.composite
def traces(draw: st.DrawFn) -> list[Arrival]:
    count = draw(st.integers(2, 40))
    estimates: dict[tuple[str, str], int | None] = {}
    at = T0
    out = []
    for n in range(count):
        at += draw(st.integers(0, 120)) * NS_PER_S
        model = draw(st.sampled_from(MODELS))
        endpoint = draw(st.sampled_from(ENDPOINTS))
        key = (model, endpoint)
        estimate = estimates.get(key)
        if estimate is None:
            # no history yet, or a first median
            if draw(st.booleans()):
                estimate = draw(st.integers(1, 1200)) * NS_PER_S
        else:
            estimate = max(0, int(estimate * draw(st.sampled_from(FACTORS))))
        estimates[key] = estimate
        out.append(
            Arrival(
                f"r{n}",
                at,
                model,
                endpoint,
                draw(st.sampled_from(PRIORITIES)),
                draw(st.sampled_from(CALLERS)),
                estimate,
                draw(st.integers(1, 600)) * NS_PER_S,
            )
        )
    return out


terms = st.builds(
    ScoringParams,
    aging_divisor_ns=st.sampled_from([0, 1, NS_PER_S, 60 * NS_PER_S, 3600 * NS_PER_S]),
    swap_affinity_bonus=st.sampled_from([0, 10]),
    fair_share_bonus=st.sampled_from([0, 20]),
    short_job_bonus=st.sampled_from([0, 1, 20, 70]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), params=terms, swap_s=st.sampled_from([0, 30]))
def test_identical_requests_are_dispatched_in_arrival_order(
    trace: list[Arrival], params: ScoringParams, swap_s: int
) -> None:
    order, _, log = run_trace(trace, params, ev.LOG_FORMAT, swap_s * NS_PER_S)
    assert sorted(order) == sorted(a.request_id for a in trace)
    assert overtaken(trace, order) == []
    # The decisions are a pure function of the log: folding it again decides the same.
    state = SchedulerState()
    for event in log:
        if isinstance(event, ev.ScoresComputed):
            again = decide(state, event.at)
            assert again is not None and again.scores == event
        apply(state, event)
