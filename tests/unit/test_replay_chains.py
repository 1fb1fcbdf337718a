"""The replay reads the chains a log names (`X-Gpulane-Chain`, issue 29) and
guesses chains from timing only in a log that names none."""

from __future__ import annotations

from app.core import events as ev
from app.core.scoring import NS_PER_S
from tools.replay.workload import extract_events

S = NS_PER_S


def shots(caller: str, chain: str | None, starts: list[int], run_s: int) -> list[ev.AnyEvent]:
    """A request per start (seconds), each running `run_s` at once on arrival."""
    out: list[ev.AnyEvent] = []
    for i, t in enumerate(starts):
        rid = f"{caller}-{i}"
        at = t * S
        out += [
            ev.RequestEnqueued(
                at=at,
                request_id=rid,
                model="video",
                model_requested="video",
                endpoint="/v1/chat/completions",
                priority=-100,
                band="batch",
                caller=caller,
                chain=chain,
                chain_length=None if chain is None else len(starts),
            ),
            ev.RequestDispatched(at=at, request_id=rid, model="video"),
            ev.RequestStarted(at=at, request_id=rid),
            ev.RequestCompleted(at=at + run_s * S, request_id=rid, http_status=200),
        ]
    return out


def extract(*groups: list[ev.AnyEvent]) -> list[tuple[str, int, int]]:
    events = sorted((e for g in groups for e in g), key=lambda e: e.at)
    w = extract_events(enumerate(events, 1))
    return [(r.request_id, r.after, r.think_ns // S) for r in w.requests]


def test_a_recorded_chain_links_each_shot_to_the_one_before() -> None:
    # A minute's thought between shots: too long for the timing guess (5 s).
    named = shots("render", "film", [0, 70, 140, 210], run_s=10)
    # Another caller's quick requests, no chain: the guess would link these.
    quick = shots("user", None, [1000, 1012, 1024], run_s=10)
    assert extract(named, quick) == [
        ("render-0", -1, 0),
        ("render-1", 0, 60),
        ("render-2", 1, 60),
        ("render-3", 2, 60),
        ("user-0", -1, 0),
        ("user-1", -1, 0),
        ("user-2", -1, 0),
    ]
    events = sorted(named + quick, key=lambda e: e.at)
    assert extract_events(enumerate(events, 1)).chains_recorded


def test_a_shot_sent_before_its_predecessor_ended_keeps_its_arrival() -> None:
    assert extract(shots("render", "film", [0, 5, 30], run_s=10)) == [
        ("render-0", -1, 0),
        ("render-1", -1, 0),  # sent while render-0 still ran
        ("render-2", 1, 15),
    ]


def test_chains_are_per_caller() -> None:
    a = shots("a", "film", [0, 20], run_s=10)
    b = shots("b", "film", [11, 40], run_s=5)
    assert extract(a, b) == [("a-0", -1, 0), ("b-0", -1, 0), ("a-1", 0, 10), ("b-1", 1, 24)]


def test_a_log_naming_no_chain_keeps_the_timing_guess() -> None:
    quick = shots("user", None, [1000, 1012, 1024], run_s=10)
    assert extract(quick) == [("user-0", -1, 0), ("user-1", 0, 2), ("user-2", 1, 2)]
    events = sorted(quick, key=lambda e: e.at)
    assert not extract_events(enumerate(events, 1)).chains_recorded
