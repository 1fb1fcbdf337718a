"""Each rule `gpulane db check` enforces, broken once, and the logs that must pass."""

from __future__ import annotations

from typing import Any

import msgspec

from app.core import events as ev
from app.store.invariants import audit

T = 1_735_689_600_000_000_000


def enq(rid: str, attempt: int = 1) -> ev.AnyEvent:
    return ev.RequestEnqueued(
        at=T,
        request_id=rid,
        model="m",
        model_requested="m",
        endpoint="/v1/chat/completions",
        priority=0,
        band="normal",
        attempt=attempt,
    )


def dispatch(rid: str, attempt: int = 1) -> ev.AnyEvent:
    return ev.RequestDispatched(at=T, request_id=rid, model="m", attempt=attempt)


def done(rid: str) -> ev.AnyEvent:
    return ev.RequestCompleted(at=T, request_id=rid, http_status=200)


def failed(rid: str) -> ev.AnyEvent:
    return ev.RequestFailed(at=T, request_id=rid, error="x")


def swap(to: str) -> ev.AnyEvent:
    return ev.SwapStarted(at=T, from_model=None, to_model=to)


def swapped(model: str) -> ev.AnyEvent:
    return ev.SwapFinished(at=T, model=model, duration_ms=1.0)


def restart() -> ev.AnyEvent:
    return ev.ServerStarted(
        at=T, version="0", config_hash="", scheduler="serial", aging_divisor_ns=0,
        swap_affinity_bonus=0,
    )  # fmt: skip


def violations(*events: ev.AnyEvent) -> list[tuple[int, str]]:
    found = audit(enumerate(events, start=1)).violations
    return [(v.seq, v.message) for v in found]


def seqs(*events: ev.AnyEvent) -> list[int]:
    return [seq for seq, _ in violations(*events)]


def test_a_valid_log_passes_and_is_counted() -> None:
    result = audit(
        enumerate(
            [
                restart(),
                enq("a"),
                enq("b"),
                swap("m"),
                dispatch("a"),
                swapped("m"),
                done("a"),
                ev.RequestCancelled(at=T, request_id="b", reason="client_gone"),
                ev.RequestRejected(
                    at=T, request_id="c", endpoint="/v1/x", http_status=400, error="bad"
                ),
            ],
            start=1,
        )
    )
    assert result.violations == []
    assert (result.events, result.requests) == (9, 3)


def test_dispatch_without_an_earlier_enqueue() -> None:
    assert violations(dispatch("ghost"), enq("ghost")) == [
        (1, "request_dispatched for ghost with no earlier request_enqueued")
    ]


def test_two_terminal_events_for_one_attempt() -> None:
    found = violations(enq("a"), dispatch("a"), done("a"), failed("a"))
    assert found == [
        (4, "second terminal event (request_failed) for a attempt 1; the first is seq 3")
    ]


def test_a_new_attempt_may_end_again() -> None:
    log = [enq("a"), dispatch("a"), failed("a"), enq("a", attempt=2), dispatch("a", 2), done("a")]
    assert violations(*log) == []
    requeued = [
        enq("a"),
        dispatch("a"),
        failed("a"),
        ev.RequestRequeued(at=T, request_id="a", attempt=2),
    ]
    assert violations(*requeued, dispatch("a", 2), done("a")) == []


def test_dispatch_after_terminal_without_a_new_attempt() -> None:
    assert seqs(enq("a"), done("a"), dispatch("a")) == [3]
    # Requeueing with the same attempt number does not open a new attempt.
    same = ev.RequestRequeued(at=T, request_id="a", attempt=1)
    assert seqs(enq("a"), dispatch("a"), failed("a"), same, dispatch("a")) == [5]
    assert seqs(enq("a"), failed("a"), enq("a", attempt=1), dispatch("a")) == [4]


def test_requeue_of_an_unknown_request() -> None:
    assert seqs(ev.RequestRequeued(at=T, request_id="x", attempt=2)) == [1]


def test_a_swap_started_inside_another() -> None:
    assert violations(swap("a"), swap("b"), swapped("b")) == [
        (2, "swap to b started while the swap to a (seq 1) is unfinished")
    ]


def test_a_swap_finished_for_another_model() -> None:
    assert violations(swap("a"), swapped("b")) == [
        (2, "swap_finished for b but the swap in progress (seq 1) is to a")
    ]


def test_a_swap_failed_with_none_in_progress() -> None:
    assert violations(swap("a"), swapped("a"), ev.SwapFailed(at=T, model="a", error="x")) == [
        (3, "swap_failed for a with no swap in progress")
    ]


def test_a_restart_ends_the_swap_in_progress() -> None:
    assert violations(swap("a"), restart(), swap("b"), swapped("b")) == []


def chained(rid: str, chain: str | None, length: int | None = None, attempt: int = 1) -> Any:
    return msgspec.structs.replace(enq(rid, attempt), chain=chain, chain_length=length)


def test_a_chain_length_needs_a_chain_and_a_request_keeps_its_chain() -> None:
    ok = [chained("a", "film", 3), dispatch("a"), done("a"), chained("a", "film", 4, attempt=2)]
    assert violations(*ok) == []
    assert violations(chained("b", None, 3), chained("c", "film", 0)) == [
        (1, "request_enqueued for b has chain_length 3 without a chain"),
        (2, "request_enqueued for c has chain_length 0 below 1"),
    ]
    moved = violations(
        chained("d", "film"), dispatch("d"), failed("d"), chained("d", None, attempt=2)
    )
    assert moved == [(4, "request_enqueued for d names chain None; its first enqueue named 'film'")]


# -- a dispatched request that nobody sends (issue 38) ---------------------------------

S = 10**9


def limited_restart(max_run_s: int = 60) -> ev.AnyEvent:
    return msgspec.structs.replace(restart(), max_run_time_ns={"m": max_run_s * S})


def at(event: ev.AnyEvent, seconds: float) -> ev.AnyEvent:
    return msgspec.structs.replace(event, at=T + round(seconds * S))


def other_request(seconds: float) -> list[ev.AnyEvent]:
    """Another request comes and goes at `seconds`: the log goes on."""
    rid = f"x{seconds:g}"
    gone = ev.RequestCancelled(at=T, request_id=rid, reason="explicit")
    return [at(enq(rid), seconds), at(gone, seconds)]


def test_a_dispatch_that_neither_starts_nor_ends_past_max_run_time_is_reported() -> None:
    """Issue 38's log: put back by an unload, dispatched again with a swap that
    finished, never started, while other requests came and went."""
    log = [
        limited_restart(),
        enq("a"),
        swap("m"),
        dispatch("a"),
        swapped("m"),
        ev.RequestStarted(at=T, request_id="a"),
        at(ev.RequestRequeued(request_id="a", attempt=1, at=T), 1),
        at(dispatch("a"), 2),
        at(swap("m"), 2),
        at(swapped("m"), 5),
        *other_request(60),  # 55 s after the load: within maxRunTime
        *other_request(76),  # 71 s: past maxRunTime and its grace
        *other_request(200),  # flagged once
    ]
    found = violations(*log)
    assert len(found) == 1, found
    seq, message = found[0]
    assert seq == 13 and "request a, dispatched at seq 8 to m" in message
    assert "neither started nor ended within its maxRunTime (60 s)" in message


def test_a_request_that_starts_or_waits_for_a_long_load_is_not_reported() -> None:
    started = [
        limited_restart(),
        enq("a"),
        swap("m"),
        at(dispatch("a"), 1),
        at(swapped("m"), 500),  # a long load: it does not count
        at(ev.RequestStarted(request_id="a", at=T), 501),
        *other_request(1000),
        at(done("a"), 2000),  # ran long: maxRunTime's own business
    ]
    assert violations(*started) == []
    no_limit = [restart(), enq("a"), dispatch("a"), *other_request(10_000)]
    assert violations(*no_limit) == []
