"""The run loop as a unit: the real `Scheduler` driven by the facts the web
layer and the upstreams report, against a fake clock, recording fake upstreams
and the in-memory event store (tests/unit/run_loop_fakes.py). No processes, no
sockets, no waiting on the wall clock: each test checks the recorded events,
the upstream starts and stops, and what each caller's ticket was told.

In the spirit of llama-swap's internal/router/scheduler/fifo_test.go, which
drives the scheduler's On* methods against a recording fakeEffects.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.core import events as ev
from app.runtime.admission import Refused
from app.runtime.api import Detached, Ticket
from app.runtime.parameters import server_started
from app.runtime.upstream import UpstreamStartError
from app.store.port import StoreError
from tests.unit.run_loop_fakes import HeldStore, Lane, config_text, settle
from tools.replay.verify import verify

NS = 10**9


def models(*names: str, **keys: Any) -> dict[str, dict[str, Any]]:
    return {name: dict(keys) for name in names}


def serial(**settings: Any) -> str:
    return config_text(models("A", "B", "C"), **settings)


async def running(lane: Lane, model: str = "A", priority: int = 0, **kw: Any) -> Ticket:
    """A request dispatched and ready on `model` (loaded for it): it holds the lane."""
    ticket = lane.admit(model, priority, **kw)
    await settle()
    assert ticket.ready.done(), "the request did not start"
    return ticket


async def served_behind_a_running_job(
    lane: Lane, requests: list[tuple[str, int]], wait_s: float = 0.0
) -> list[int]:
    """Queue `requests` (`wait_s` apart) while a job on A runs, then serve
    everything; the requests' indexes in dispatch order."""
    blocker = await running(lane, "A")
    tickets = []
    for model, priority in requests:
        tickets.append(lane.admit(model, priority))
        await lane.clock.advance(wait_s)
    await lane.finish(blocker)
    await lane.serve_all()
    return lane.order(tickets)


def swaps_to(lane: Lane) -> list[str]:
    return [e.to_model for e in lane.events(ev.SwapStarted)]


# -- dispatch --------------------------------------------------------------------------


async def test_a_request_on_an_idle_lane_loads_its_model_then_runs() -> None:
    lane = Lane(serial(), auto_load=False)
    ticket = lane.admit("A", 100)
    await settle()
    assert lane.types() == [
        "request_enqueued",
        "scores_computed",
        "request_dispatched",
        "swap_started",
        "process_started",
    ]
    assert not ticket.ready.done()  # not before the model answers its health check
    upstream = lane.upstreams.last("A")
    assert upstream.loading
    await lane.clock.advance(3)
    upstream.load()
    await settle()
    assert ticket.ready.result() == lane.config.models["A"].proxy
    swap, started, finished = lane.events(ev.SwapStarted, ev.ProcessStarted, ev.SwapFinished)
    assert (swap.from_model, swap.to_model, swap.request_id) == (None, "A", ticket.request_id)
    assert (started.pid, started.port) == (upstream.pid, lane.config.models["A"].port)
    assert finished.duration_ms == 3000
    assert (ticket.score, ticket.queue_wait_ms) == (100, 0)
    await lane.finish(ticket)
    assert lane.ended(ticket).http_status == 200
    assert lane.scheduler.state.resident == "A"


async def test_requests_are_served_by_priority_while_a_job_runs() -> None:
    lane = Lane(serial(swapAffinityBonus=0))
    order = await served_behind_a_running_job(
        lane, [("A", -100), ("A", 0), ("A", 100), ("A", 101), ("A", -99)]
    )
    assert order == [3, 2, 1, 4, 0]  # 101 > interactive > normal > -99 > batch
    assert lane.upstreams.calls == [("start", "A")]


async def test_a_b_c_a_with_a_resident_and_bonus_10_is_served_a_a_b_c() -> None:
    lane = Lane(serial(swapAffinityBonus=10))
    order = await served_behind_a_running_job(lane, [("A", 0), ("B", 0), ("C", 0), ("A", 0)])
    assert order == [0, 3, 1, 2]
    assert swaps_to(lane) == ["A", "B", "C"]
    assert lane.upstreams.calls == [
        ("start", "A"),
        ("stop", "A"),
        ("start", "B"),
        ("stop", "B"),
        ("start", "C"),
    ]
    # The pick affinity changed: the second A over B, recorded as such.
    picks = lane.events(ev.ScoresComputed)
    assert (picks[2].winner.affinity, picks[2].without_affinity_id) == (
        10,
        lane.dispatched()[3],
    )
    evicted = lane.events(ev.ProcessStopped)
    assert [(e.model, e.reason) for e in evicted] == [("A", "evicted"), ("B", "evicted")]


async def test_a_b_c_a_at_bonus_zero_is_arrival_order() -> None:
    lane = Lane(serial(swapAffinityBonus=0))
    order = await served_behind_a_running_job(lane, [("A", 0), ("B", 0), ("C", 0), ("A", 0)])
    assert order == [0, 1, 2, 3]
    assert swaps_to(lane) == ["A", "B", "C", "A"]


@pytest.mark.parametrize(
    ("bonus", "batch_model", "wait_s", "first"),
    [
        # agingDivisor 0.004 s: 200 points of band cross in 0.8 s ...
        (0, "A", 0.79, "interactive"),
        (0, "A", 0.81, "batch"),
        # ... plus the bonus when the interactive request needs no swap: 0.84 s.
        (10, "B", 0.83, "interactive"),
        (10, "B", 0.85, "batch"),
    ],
)
async def test_aging_lifts_a_batch_request_over_a_fresh_interactive_one_past_the_bound(
    bonus: int, batch_model: str, wait_s: float, first: str
) -> None:
    lane = Lane(serial(agingDivisor=0.004, swapAffinityBonus=bonus))
    order = await served_behind_a_running_job(
        lane, [(batch_model, -100), ("A", 100)], wait_s=wait_s
    )
    assert order == ([0, 1] if first == "batch" else [1, 0])


async def test_without_aging_the_interactive_request_goes_first_however_long_batch_waited() -> None:
    lane = Lane(serial(agingDivisor=0, swapAffinityBonus=0))
    assert await served_behind_a_running_job(lane, [("A", -100), ("A", 100)], wait_s=3600) == [1, 0]


async def test_the_queue_wait_and_score_are_measured_on_the_clock() -> None:
    lane = Lane(serial(agingDivisor=1, swapAffinityBonus=0))
    blocker = await running(lane)
    waiting = lane.admit("A", 5)
    await lane.clock.advance(1.5)
    await lane.finish(blocker)
    assert waiting.queue_wait_ms == 1500
    assert waiting.score == 6.5  # priority 5 + 1.5 s of aging at one point a second


# -- cancellation ----------------------------------------------------------------------


async def test_a_queued_request_cancelled_leaves_the_queue_and_its_model_is_never_loaded() -> None:
    lane = Lane(serial(swapAffinityBonus=0))
    blocker = await running(lane)
    gone = lane.admit("B")
    after = lane.admit("A")
    assert lane.scheduler.cancel_any(gone.request_id) == "queued"
    assert gone.ready.cancelled()
    assert lane.ended(gone).reason == "explicit"
    assert lane.scheduler.cancel_any(gone.request_id) is None  # already ended
    await lane.finish(blocker)
    await lane.serve_all()
    assert gone.request_id not in lane.dispatched()
    assert after.request_id in lane.dispatched()
    assert swaps_to(lane) == ["A"]


async def test_a_queued_client_that_leaves_is_recorded_client_gone() -> None:
    lane = Lane(serial())
    blocker = await running(lane)
    gone = lane.admit("A")
    lane.scheduler.client_gone(gone.request_id)
    assert lane.ended(gone).reason == "client_gone"
    await lane.finish(blocker)
    assert lane.scheduler.state.requests == {}


async def test_a_client_leaving_while_its_model_loads_frees_the_lane_and_the_load_finishes() -> (
    None
):
    lane = Lane(serial(), auto_load=False)
    gone = lane.admit("A")
    await settle()
    lane.scheduler.client_gone(gone.request_id)
    assert lane.ended(gone).reason == "client_gone"
    assert gone.ready.cancelled()
    lane.upstreams.last("A").load()
    await settle()
    assert lane.events(ev.SwapFinished)[0].model == "A"
    # The load was not wasted: the next request for A runs on it.
    after = await running(lane)
    assert lane.events(ev.RequestDispatched)[-1].swap is False
    assert lane.upstreams.calls == [("start", "A")]
    await lane.finish(after)


async def test_an_operator_cancels_a_request_whose_model_is_loading() -> None:
    lane = Lane(serial(), auto_load=False)
    ticket = lane.admit("A")
    await settle()
    assert lane.scheduler.cancel_any(ticket.request_id) == "running"
    assert ticket.detached.result() == Detached(
        409, "request_cancelled", f"request {ticket.request_id} was cancelled"
    )
    assert lane.ended(ticket).reason == "explicit"


# -- upstream faults -------------------------------------------------------------------


async def test_a_failed_start_fails_the_request_502_and_the_lane_moves_on() -> None:
    lane = Lane(serial(), auto_load=False)
    broken = lane.admit("A")
    next_one = lane.admit("B")
    await settle()
    upstream = lane.upstreams.last("A")
    upstream.fail("exited with code 3 during start")
    await settle()
    assert isinstance(broken.ready.exception(), UpstreamStartError)
    failed = lane.ended(broken)
    assert failed.http_status == 502 and "exited with code 3 during start" in failed.error
    assert "exited with code 3" in lane.events(ev.SwapFailed)[0].error
    stopped = lane.events(ev.ProcessStopped)
    assert [(e.model, e.pid, e.reason) for e in stopped] == [("A", upstream.pid, "failed_start")]
    assert "A" not in lane.scheduler.loaded_models()
    # The lane moved on: B loads and runs.
    lane.upstreams.last("B").load()
    await lane.finish(next_one)
    assert swaps_to(lane) == ["A", "B"]


async def test_a_start_refused_before_spawning_records_no_process() -> None:
    lane = Lane(serial())
    lane.upstreams.refuse["A"] = "port 5800 is already in use"
    ticket = lane.admit("A")
    await settle()
    assert lane.ended(ticket).http_status == 502
    assert "port 5800 is already in use" in lane.events(ev.SwapFailed)[0].error
    assert lane.events(ev.ProcessStarted, ev.ProcessStopped) == []


async def test_a_swap_starts_the_next_model_only_once_the_last_one_has_stopped() -> None:
    lane = Lane(serial())
    await lane.finish(await running(lane))
    before = len(lane.events())
    lane.upstreams.hold_stops()
    ticket = lane.admit("B")
    await settle()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]  # B waits for the GPU
    lane.upstreams.release_stops()
    await lane.finish(ticket)
    assert lane.upstreams.calls[-1] == ("start", "B")
    assert lane.types()[before:] == [
        "request_enqueued",
        "scores_computed",
        "request_dispatched",
        "swap_started",
        "process_stopping",
        "process_stopped",  # A's stop is on record before B's process is
        "process_started",
        "swap_finished",
        "request_started",
        "request_completed",
    ]


async def test_a_crash_while_idle_is_recorded_and_the_next_request_loads_again() -> None:
    lane = Lane(serial())
    await lane.finish(await running(lane))
    first = lane.upstreams.last("A")
    first.crash(139)
    await settle()
    stopped = lane.events(ev.ProcessStopped)
    assert [(e.pid, e.reason, e.exit_code) for e in stopped] == [(first.pid, "crashed", 139)]
    assert lane.scheduler.state.resident is None and lane.scheduler.loaded_models() == []
    again = await running(lane)
    assert lane.events(ev.RequestDispatched)[-1].swap is True
    assert lane.upstreams.calls == [("start", "A"), ("start", "A")]
    await lane.finish(again)


async def test_a_crash_mid_request_then_the_reported_failure_frees_the_lane() -> None:
    lane = Lane(serial())
    ticket = await running(lane)
    waiting = lane.admit("A")
    lane.upstreams.last("A").crash(1)
    await settle()
    assert lane.events(ev.ProcessStopped)[0].reason == "crashed"
    assert not waiting.ready.done()  # the lane is still the crashed request's
    lane.scheduler.failed(ticket.request_id, "upstream ended the response early", 200)
    await lane.finish(waiting)  # on a fresh process
    assert lane.ended(ticket).error == "upstream ended the response early"
    assert lane.upstreams.calls == [("start", "A"), ("start", "A")]


@pytest.mark.parametrize("crash_seen_first", [True, False])
async def test_a_crash_racing_a_dispatch_reloads_the_model_for_that_request(
    crash_seen_first: bool,
) -> None:
    lane = Lane(serial())
    await lane.finish(await running(lane))
    ticket = await running(lane)  # sent to the process that is about to die
    lane.upstreams.last("A").crash(137)
    if crash_seen_first:
        await settle()  # the watcher records the crash before the proxy notices
    reload = asyncio.ensure_future(lane.scheduler.reload_crashed(ticket.request_id))
    await settle()
    assert reload.done() and reload.result() is True
    assert ticket.ready.result() == lane.config.models["A"].proxy
    assert lane.upstreams.calls == [("start", "A"), ("start", "A")]
    tail = lane.types()[lane.types().index("process_stopped") :]
    assert tail == ["process_stopped", "swap_started", "process_started", "swap_finished"]
    assert lane.events(ev.SwapStarted)[-1].request_id == ticket.request_id
    await lane.finish(ticket)
    assert lane.dispatched().count(ticket.request_id) == 1
    assert lane.scheduler.state.resident == "A"


async def test_a_run_past_max_run_time_fails_504_restarts_the_upstream_and_frees_the_lane() -> None:
    lane = Lane(config_text(models("A", maxRunTime=5)))
    hung = await running(lane)
    waiting = lane.admit("A")
    await lane.clock.advance(4.999)
    assert lane.events(ev.RequestFailed) == []
    await lane.clock.advance(0.001)
    failed = lane.ended(hung)
    assert failed.http_status == 504 and "maxRunTime (5 s)" in failed.error
    assert failed.at == lane.clock.now_ns
    detached = hung.detached.result()
    assert (detached.status, detached.code) == (504, "upstream_timeout")
    assert [(e.model, e.reason) for e in lane.events(ev.ProcessStopped)] == [("A", "hung")]
    # The next request loads A afresh, and a late answer from the hung one is ignored.
    assert waiting.ready.done()
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A"), ("start", "A")]
    # The log says so: A stopped being resident when its stop began, so the
    # next dispatch is recorded as the swap it is, with no affinity bonus.
    nxt = [e for e in lane.events(ev.RequestDispatched) if e.request_id == waiting.request_id]
    assert [e.swap for e in nxt] == [True]
    scores = [e for e in lane.events(ev.ScoresComputed) if e.request_id == waiting.request_id]
    assert scores[0].winner.affinity == 0
    lane.scheduler.completed(hung.request_id, 200)
    await lane.finish(waiting)
    assert lane.ended(hung) == failed


async def test_a_request_that_ends_in_time_leaves_no_deadline_behind() -> None:
    lane = Lane(config_text(models("A", maxRunTime=5)))
    await lane.finish(await running(lane))
    assert lane.clock.pending() == []
    await lane.clock.advance(60)
    assert lane.events(ev.RequestFailed, ev.ProcessStopped) == []


async def test_an_upstream_reported_hung_is_restarted_for_the_next_request() -> None:
    lane = Lane(serial())
    ticket = await running(lane)
    message = "upstream 'A' sent no response headers within timeouts.responseHeader (1 s)"
    lane.scheduler.failed(ticket.request_id, message, 504, hung=True)
    await settle()
    assert lane.ended(ticket).http_status == 504
    assert [e.reason for e in lane.events(ev.ProcessStopped)] == ["hung"]
    await lane.finish(await running(lane))
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A"), ("start", "A")]


async def test_an_operator_cancels_a_running_request_and_the_next_runs_at_once() -> None:
    lane = Lane(serial())
    stuck = await running(lane)
    waiting = lane.admit("A")
    assert lane.scheduler.cancel_any(stuck.request_id) == "running"
    assert lane.ended(stuck).reason == "explicit"
    assert stuck.detached.result().status == 409
    await settle()
    assert waiting.ready.done()  # the lane did not wait for the upstream to answer
    assert lane.scheduler.cancel_any(waiting.request_id) == "running"
    assert lane.scheduler.cancel_any(stuck.request_id) is None  # already ended
    assert lane.scheduler.cancel_any("no-such-request") is None
    assert lane.upstreams.calls == [("start", "A")]  # cancelling does not restart it


async def test_an_operator_cancels_a_queued_request() -> None:
    lane = Lane(serial())
    blocker = await running(lane)
    queued = lane.admit("B")
    assert lane.scheduler.cancel_any(queued.request_id) == "queued"
    assert queued.detached.result().code == "request_cancelled"
    await lane.finish(blocker)
    assert swaps_to(lane) == ["A"]


async def test_a_serving_task_that_raises_ends_its_request_failed_500() -> None:
    lane = Lane(serial())
    ticket = await running(lane)
    waiting = lane.admit("A")

    async def serve() -> None:
        raise RuntimeError("boom")

    lane.scheduler.supervise(ticket.request_id, asyncio.ensure_future(serve()))
    await settle()
    failed = lane.ended(ticket)
    assert failed.http_status == 500
    assert failed.error == "internal error: the task serving the request raised RuntimeError: boom"
    assert waiting.ready.done()


async def test_a_serving_task_that_returns_while_queued_is_recorded_client_gone() -> None:
    lane = Lane(serial())
    blocker = await running(lane)
    queued = lane.admit("A")

    async def handler_returns() -> None:
        return None

    lane.scheduler.supervise(queued.request_id, asyncio.ensure_future(handler_returns()))
    await settle()
    assert lane.ended(queued).reason == "client_gone"
    await lane.finish(blocker)


# -- back-off after failed loads -------------------------------------------------------


def backing_off(**settings: Any) -> str:
    """Models A and B, with top-level settings (`loadBackoff=5`, ...)."""
    config = json.loads(config_text(models("A", "B")))
    return json.dumps(config | settings)


async def test_a_model_that_fails_to_load_waits_its_backoff_while_another_is_served() -> None:
    lane = Lane(backing_off(loadBackoff=5, loadBackoffMax=300, loadFailureLimit=3))
    lane.upstreams.refuse["A"] = "port 5800 is already in use"
    lines = [lane.admit("A", 100, durable=True) for _ in range(5)]
    other = lane.admit("B")
    await settle()
    assert len(lane.events(ev.SwapFailed)) == 1
    assert lane.ended(lines[0]).http_status == 502  # the one the load was for
    # A backs off: B is served meanwhile, though A's lines outrank it.
    await lane.finish(other)
    assert swaps_to(lane) == ["A", "B"]
    await lane.clock.advance(4.999)
    assert len(lane.events(ev.SwapFailed)) == 1
    await lane.clock.advance(0.001)  # 5 s after the first failure: one more load
    assert len(lane.events(ev.SwapFailed)) == 2
    await lane.clock.advance(9.999)  # then 10 s
    assert len(lane.events(ev.SwapFailed)) == 2
    await lane.clock.advance(0.001)
    failed = lane.events(ev.SwapFailed)
    assert len(failed) == 3 and [e.at - failed[0].at for e in failed] == [0, 5 * NS, 15 * NS]
    # The third failure in a row (loadFailureLimit 3) fails the lines still waiting.
    for line in lines[3:]:
        end = lane.ended(line)
        assert end.http_status == 502
        assert "failed to load 3 times in a row (loadFailureLimit 3)" in end.error
        assert "port 5800 is already in use" in end.error
        assert isinstance(line.ready.exception(), UpstreamStartError)
    assert lane.scheduler.state.requests == {}
    assert verified(lane)


async def test_a_load_that_works_after_a_failure_serves_every_waiting_request() -> None:
    lane = Lane(backing_off(loadBackoff=2))
    lane.upstreams.refuse["A"] = "CUDA out of memory"
    tickets = [lane.admit("A") for _ in range(3)]
    await settle()
    assert lane.ended(tickets[0]).http_status == 502
    del lane.upstreams.refuse["A"]  # transient: the next load works
    await lane.clock.advance(1.5)
    assert len(lane.events(ev.SwapStarted)) == 1
    await lane.clock.advance(0.5)
    await lane.serve_all()
    assert [type(lane.ended(t)).__name__ for t in tickets[1:]] == ["RequestCompleted"] * 2
    assert swaps_to(lane) == ["A", "A"]
    assert lane.scheduler.state.load_failures == {}
    assert verified(lane)


async def test_a_backoff_of_0_loads_again_at_once() -> None:
    lane = Lane(backing_off(loadBackoff=0, loadFailureLimit=0))
    lane.upstreams.refuse["A"] = "port 5800 is already in use"
    tickets = [lane.admit("A") for _ in range(4)]
    await settle()
    assert all("port 5800 is already in use" in lane.ended(t).error for t in tickets)
    assert all(isinstance(t.ready.exception(), UpstreamStartError) for t in tickets)
    assert len(lane.events(ev.SwapFailed)) == 4
    assert verified(lane)


# -- TTL and unload --------------------------------------------------------------------


async def test_an_idle_model_is_stopped_ttl_seconds_after_its_last_request() -> None:
    lane = Lane(config_text(models("A", ttl=2)))
    ticket = await running(lane)
    await lane.clock.advance(0.5)
    await lane.finish(ticket)
    await lane.clock.advance(1.999)
    assert lane.events(ev.ProcessStopped) == []
    await lane.clock.advance(0.001)
    (stopped,) = lane.events(ev.ProcessStopped)
    assert stopped.reason == "ttl"
    assert stopped.at - lane.ended(ticket).at == 2 * NS
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A")]
    await lane.finish(await running(lane))  # loaded again on demand
    assert lane.upstreams.calls[-1] == ("start", "A")


async def test_ttl_never_stops_a_busy_model_and_counts_from_the_last_request() -> None:
    lane = Lane(config_text(models("A", ttl=2)))
    first = await running(lane)  # the load arms a check at 2 s
    await lane.clock.advance(1)
    second = lane.admit("A")
    await lane.finish(first)  # 1 s: arms a check at 3 s
    await lane.clock.advance(2.5)  # both checks fire while `second` runs
    assert lane.events(ev.ProcessStopped) == []
    await lane.finish(second)  # 3.5 s
    await lane.clock.advance(1.999)
    assert lane.events(ev.ProcessStopped) == []
    await lane.clock.advance(0.001)
    assert [e.reason for e in lane.events(ev.ProcessStopped)] == ["ttl"]


async def test_a_request_arriving_while_ttl_stops_its_model_loads_it_again() -> None:
    lane = Lane(config_text(models("A", ttl=2)))
    await lane.finish(await running(lane))
    lane.upstreams.hold_stops()
    await lane.clock.advance(2)
    assert lane.upstreams.calls[-1] == ("stop", "A")
    ticket = lane.admit("A")  # the stop is not done: A is still resident in the log
    await settle()
    assert not ticket.ready.done()
    lane.upstreams.release_stops()
    await lane.finish(ticket)
    assert lane.upstreams.calls == [("start", "A"), ("stop", "A"), ("start", "A")]
    assert [e.reason for e in lane.events(ev.ProcessStopped)] == ["ttl"]
    assert lane.scheduler.state.resident == "A"


async def test_without_ttl_an_idle_model_stays_loaded() -> None:
    lane = Lane(serial())
    await lane.finish(await running(lane))
    await lane.clock.advance(86400)
    assert lane.events(ev.ProcessStopped) == [] and lane.clock.pending() == []


async def test_unload_answers_once_stopped_and_ends_what_runs_on_the_model() -> None:
    lane = Lane(serial())
    sync = await running(lane)
    lane.upstreams.hold_stops()
    unloading = asyncio.ensure_future(lane.scheduler.unload("A"))
    await settle()
    assert not unloading.done()  # the stop has not ended yet
    failed = lane.ended(sync)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 503
    assert "unloaded by an operator" in failed.error
    assert sync.detached.result().code == "model_unloaded"
    lane.upstreams.release_stops()
    assert await unloading == ["A"]
    assert [(e.model, e.reason) for e in lane.events(ev.ProcessStopped)] == [("A", "unload")]
    assert await lane.scheduler.unload("B") == []


async def test_unload_requeues_a_running_job_and_keeps_waiting_requests() -> None:
    lane = Lane(serial())
    sent_again: list[Ticket] = []
    lane.scheduler.on_put_back(lambda ticket, job: sent_again.append(ticket))
    job = await running(lane, durable=True)
    job.job = {"path": "/v1/chat"}  # what Jobs.run sets: the job to send again
    waiting = lane.admit("A")
    await settle()
    unloading = asyncio.ensure_future(lane.scheduler.unload(None))
    lane.upstreams.release_stops()
    assert await unloading == ["A"]
    requeued = lane.events(ev.RequestRequeued)
    assert [e.request_id for e in requeued] == [job.request_id]
    assert lane.events(ev.RequestFailed) == []
    assert [t.request_id for t in sent_again] == [job.request_id]  # on a fresh ticket
    assert waiting.request_id in lane.scheduler.state.requests  # still queued, not lost


# -- preload ---------------------------------------------------------------------------


async def test_preload_loads_a_model_that_then_serves_without_a_swap() -> None:
    lane = Lane(serial())
    lane.scheduler.preload("B")
    await settle()
    assert lane.types() == ["swap_started", "process_started", "swap_finished"]
    swap = lane.events(ev.SwapStarted)[0]
    assert (swap.to_model, swap.request_id) == ("B", None)
    ticket = await running(lane, "B")
    assert lane.events(ev.RequestDispatched)[0].swap is False
    await lane.finish(ticket)
    assert lane.upstreams.calls == [("start", "B")]


async def test_preload_waits_for_nobody_and_swaps_nothing_out_from_under_a_request() -> None:
    lane = Lane(serial())
    ticket = await running(lane)
    lane.scheduler.preload("B")  # the lane is busy: not now
    lane.scheduler.preload("A")  # already resident
    await settle()
    assert swaps_to(lane) == ["A"]
    await lane.finish(ticket)


# -- serial with slots (concurrencyLimit) ---------------------------------------------


def with_slots(**limits: int) -> str:
    return config_text({m: {"concurrencyLimit": n} for m, n in limits.items()})


def verified(lane: Lane) -> bool:
    """`replay --verify` of the lane's log, after the `server_started` serve records."""
    log = [server_started(lane.config, 0, 0), *lane.events()]
    result = verify(enumerate(log, start=1))
    return result.ok and result.decisions == len(lane.dispatched())


async def test_serial_runs_a_resident_model_up_to_its_concurrency_limit() -> None:
    lane = Lane(with_slots(A=3, B=1))
    blocker = await running(lane, "B")
    tickets = [lane.admit("A", p) for p in (-100, -100, 0, 100)]
    await settle()
    assert not any(t.ready.done() for t in tickets)
    await lane.finish(blocker)
    # the best three take A's slots in score order; the last batch one waits
    assert [t.ready.done() for t in tickets] == [True, False, True, True]
    assert lane.order(tickets) == [3, 2, 0]
    assert len(lane.events(ev.SwapStarted)) == 2  # B, then A once (the others joined)
    await lane.finish(tickets[2])
    assert tickets[1].ready.done()
    await lane.serve_all()
    assert lane.upstreams.calls == [("start", "B"), ("stop", "B"), ("start", "A")]
    assert verified(lane)


async def test_serial_requests_join_the_load_their_model_is_in_up_to_its_slots() -> None:
    lane = Lane(with_slots(A=3), auto_load=False)
    tickets = [lane.admit("A") for _ in range(4)]
    await settle()
    assert [e.swap for e in lane.events(ev.RequestDispatched)] == [True, False, False]
    assert not any(t.ready.done() for t in tickets)
    lane.upstreams.last("A").load()
    await settle()
    assert [t.ready.done() for t in tickets] == [True, True, True, False]
    await lane.serve_all()
    assert len(lane.events(ev.SwapStarted)) == 1
    assert verified(lane)


async def test_serial_a_higher_request_for_another_model_drains_the_slots_then_swaps() -> None:
    lane = Lane(with_slots(A=3, B=1))
    a1, a2 = await running(lane, "A"), await running(lane, "A")
    b = lane.admit("B", 0)
    later = lane.admit("A", -100)  # a slot of A is free, but b outranks it
    await settle()
    assert not b.ready.done() and not later.ready.done()
    await lane.finish(a1)
    assert swaps_to(lane) == ["A"] and not later.ready.done()
    await lane.finish(a2)  # drained: the swap happens now
    assert swaps_to(lane) == ["A", "B"] and b.ready.done()
    await lane.finish(b)
    assert later.ready.done() and swaps_to(lane) == ["A", "B", "A"]
    await lane.finish(later)
    assert verified(lane)


async def test_serial_a_failed_load_fails_every_request_that_joined_it() -> None:
    lane = Lane(with_slots(A=2, B=1), auto_load=False)
    joined = [lane.admit("A") for _ in range(2)]
    other = lane.admit("B")
    await settle()
    lane.upstreams.last("A").fail()
    await settle()
    assert [lane.ended(t).http_status for t in joined] == [502, 502]
    lane.upstreams.last("B").load()
    await lane.finish(other)
    assert verified(lane)


async def test_serial_a_preload_is_not_joined_its_slots_fill_when_it_ends() -> None:
    lane = Lane(with_slots(A=2), auto_load=False)
    lane.scheduler.preload("A")
    tickets = [lane.admit("A") for _ in range(3)]
    await settle()
    assert lane.dispatched() == []
    lane.upstreams.last("A").load()
    await settle()
    assert [t.ready.done() for t in tickets] == [True, True, False]
    assert not any(e.swap for e in lane.events(ev.RequestDispatched))
    await lane.serve_all()
    assert verified(lane)


async def test_serial_without_a_concurrency_limit_runs_one_at_a_time() -> None:
    lane = Lane(serial())
    assert lane.events() == [] and lane.scheduler.state.slots("A") == 1
    first = await running(lane, "A")
    second = lane.admit("A")
    await settle()
    assert not second.ready.done()
    await lane.finish(first)
    await lane.finish(second)


# -- fifo ------------------------------------------------------------------------------


def fifo(priority: dict[str, int] | None = None, **keys: Any) -> str:
    return config_text(models("A", "B", **keys), "fifo", priority=priority or {})


async def test_fifo_orders_the_queue_by_model_priority_plus_header() -> None:
    lane = Lane(fifo({"A": 0, "B": 10}, concurrencyLimit=1))
    # Queue priorities: A 0, B 10, A+interactive 100, B+batch -90.
    order = await served_behind_a_running_job(lane, [("A", 0), ("B", 0), ("A", 100), ("B", -100)])
    assert order == [2, 1, 0, 3]
    assert swaps_to(lane) == ["A", "B", "A", "B"]


async def test_fifo_runs_a_ready_model_up_to_its_concurrency_limit() -> None:
    lane = Lane(fifo(concurrencyLimit=3))
    await lane.finish(await running(lane))
    tickets = [lane.admit("A") for _ in range(6)]
    await settle()
    assert [t.ready.done() for t in tickets] == [True] * 3 + [False] * 3
    await lane.finish(tickets[0])
    assert tickets[3].ready.done() and not tickets[4].ready.done()
    await lane.serve_all()
    assert lane.order(tickets) == [0, 1, 2, 3, 4, 5]
    assert lane.upstreams.calls == [("start", "A")]


async def test_fifo_requests_for_a_model_being_loaded_join_that_load() -> None:
    lane = Lane(fifo(concurrencyLimit=3), auto_load=False)
    tickets = [lane.admit("A") for _ in range(4)]
    await settle()
    assert [e.swap for e in lane.events(ev.RequestDispatched)] == [True, False, False]
    assert lane.upstreams.calls == [("start", "A")]
    assert not any(t.ready.done() for t in tickets)
    lane.upstreams.last("A").load()
    await settle()
    assert [t.ready.done() for t in tickets] == [True, True, True, False]
    await lane.serve_all()
    assert len(lane.events(ev.SwapStarted)) == 1


async def test_fifo_a_failed_load_fails_every_request_that_joined_it() -> None:
    lane = Lane(fifo(concurrencyLimit=3), auto_load=False)
    joined = [lane.admit("A") for _ in range(3)]
    other = lane.admit("B")
    await settle()
    lane.upstreams.last("A").fail()
    await settle()
    assert [lane.ended(t).http_status for t in joined] == [502, 502, 502]
    assert all(isinstance(t.ready.exception(), UpstreamStartError) for t in joined)
    lane.upstreams.last("B").load()
    await lane.finish(other)


async def test_fifo_waits_for_the_model_in_use_to_drain_before_swapping() -> None:
    lane = Lane(fifo(concurrencyLimit=2))
    a1, a2 = await running(lane), await running(lane)
    b = lane.admit("B")
    await lane.finish(a1)
    assert swaps_to(lane) == ["A"] and not b.ready.done()
    await lane.finish(a2)
    assert swaps_to(lane) == ["A", "B"] and b.ready.done()


# -- graceful stop ---------------------------------------------------------------------


async def test_drain_answers_waiting_clients_503_keeps_jobs_queued_and_lets_running_work_end() -> (
    None
):
    lane = Lane(serial())
    blocker = await running(lane)
    waiting = lane.admit("B")
    job = lane.admit("B", durable=True)
    drain = asyncio.ensure_future(lane.scheduler.drain(grace=30))
    await settle()
    assert lane.ended(waiting).reason == "shutdown"
    assert waiting.detached.result() == Detached(
        503, "shutting_down", "gpulane is shutting down; retry in a moment"
    )
    with pytest.raises(Refused, match="shutting down"):
        lane.admit("A")
    assert not drain.done()  # the running request may finish
    await lane.finish(blocker)
    assert drain.done()
    # The durable job stays queued for the next start; nothing was swapped in for it.
    assert not lane.scheduler.state.requests[job.request_id].running
    assert job.request_id not in lane.dispatched()
    assert swaps_to(lane) == ["A"] and ("start", "B") not in lane.upstreams.calls
    lane.scheduler.preload("B")
    await settle()
    assert swaps_to(lane) == ["A"]


async def test_drain_puts_a_running_durable_job_back_on_the_same_attempt_after_the_grace() -> None:
    lane = Lane(serial())
    job = await running(lane, durable=True)
    await lane.scheduler.drain(grace=0)
    (requeued,) = lane.events(ev.RequestRequeued)
    assert (requeued.request_id, requeued.attempt) == (job.request_id, 1)
    assert job.detached.result().status == 503
    assert not lane.scheduler.state.requests[job.request_id].running
    assert lane.events(ev.RequestFailed, ev.RequestCancelled, ev.RequestCompleted) == []
    assert await lane.scheduler.reload_crashed(job.request_id) is False


async def test_drain_fails_a_running_synchronous_request_after_the_grace() -> None:
    lane = Lane(serial())
    ticket = await running(lane)
    await lane.scheduler.drain(grace=0)
    failed = lane.ended(ticket)
    assert failed.http_status == 503 and "shutdownGrace 0 s" in failed.error
    assert ticket.detached.result().code == "shutting_down"


# -- durable admission -----------------------------------------------------------------


async def test_a_durable_job_is_not_dispatched_before_its_enqueue_is_on_disk() -> None:
    store = HeldStore()
    lane = Lane(serial(), store=store)
    store.hold()
    job = lane.admit("A", durable=True)
    sync = lane.admit("A", -100)  # behind the job: it waits for the job's commit too
    await settle()
    assert job.committed is not None and not job.committed.done()
    assert lane.scheduler.state.running == {}
    store.release()
    await settle()
    assert lane.dispatched() == [job.request_id]
    await lane.serve_all()
    assert lane.order([job, sync]) == [0, 1]


async def test_a_durable_job_whose_commit_fails_leaves_no_trace_and_the_lane_moves_on() -> None:
    store = HeldStore()
    lane = Lane(serial(), store=store)
    store.hold()
    job = lane.admit("A", durable=True)
    store.fail("disk I/O error")
    await settle()
    assert job.committed is not None
    assert isinstance(job.committed.exception(), StoreError)
    assert job.ready.cancelled()
    assert lane.scheduler.state.requests == {} and lane.events() == []
    await lane.finish(await running(lane))
    assert lane.types().count("request_enqueued") == 1


async def test_admission_is_refused_when_the_event_log_cannot_be_written() -> None:
    lane = Lane(serial())
    lane.store.failure = "disk full"
    with pytest.raises(Refused, match="the event log cannot be written: disk full"):
        lane.admit("A")
    assert lane.scheduler.state.requests == {}


async def test_shutdown_during_a_load_ends_the_swap_and_stops_the_process_once() -> None:
    lane = Lane(serial(), auto_load=False)
    ticket = lane.admit("A")
    await settle()
    await lane.scheduler.drain(grace=0)
    await lane.scheduler.shutdown()
    await settle()
    assert lane.ended(ticket).http_status == 503
    assert [e.reason for e in lane.events(ev.ProcessStopped)] == ["shutdown"]
    assert len(lane.events(ev.SwapFinished, ev.SwapFailed)) == 1  # the swap is closed


async def test_shutdown_stops_every_upstream() -> None:
    lane = Lane(serial())
    await lane.finish(await running(lane))
    await lane.scheduler.shutdown()
    assert [(e.model, e.reason) for e in lane.events(ev.ProcessStopped)] == [("A", "shutdown")]
    assert lane.scheduler.loaded_models() == []
