"""An operator's unload under a running request, as a run-loop unit (issue 38).

The matrix: a durable job or a synchronous request running when its model is
unloaded, under the serial and fifo schedulers and with slots
(`concurrencyLimit: 2`). Whatever runs is put back (a durable job, sent again
on a fresh ticket by the jobs layer's hook) or failed (503), and afterwards a
synchronous chat for the same model and for another one is answered: nothing
is left dispatched with nobody to send it (the wedge issue 38 measured).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.core import events as ev
from app.runtime.api import Ticket
from app.runtime.scheduler import Scheduler
from app.store.invariants import audit
from tests.unit.run_loop_fakes import Lane, config_text, settle

SCHEDULES = {
    "serial": ({}, "serial"),
    "fifo": ({}, "fifo"),
    "slots": ({"concurrencyLimit": 2}, "serial"),
}


class Sender:
    """The jobs layer's part (`Jobs.run`): a durable ticket is sent when it is
    ready; a job the scheduler puts back comes back through `on_put_back`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.sent: list[Ticket] = []
        scheduler.on_put_back(self.run)

    def run(self, ticket: Ticket, job: Any) -> None:
        ticket.job = job

        def turn_came(ready: asyncio.Future[str]) -> None:
            if not ready.cancelled() and ready.exception() is None:
                self.sent.append(ticket)
                self.scheduler.started(ticket.request_id)

        ticket.ready.add_done_callback(turn_came)


def lane_for(schedule: str) -> tuple[Lane, Sender]:
    keys, scheduler = SCHEDULES[schedule]
    models = {name: {"maxRunTime": 60} | keys for name in ("A", "B")}
    lane = Lane(config_text(models, scheduler))
    return lane, Sender(lane.scheduler)


async def start_running(lane: Lane, sender: Sender, kind: str) -> Ticket:
    ticket = lane.admit("A", durable=kind == "durable")
    if kind == "durable":
        sender.run(ticket, {"method": "POST", "path": "/v1/chat/completions"})
    await settle()
    assert ticket.ready.done(), "the request did not start"
    if kind == "sync":
        lane.scheduler.started(ticket.request_id)
    return ticket


def terminal(lane: Lane, request_id: str) -> list[Any]:
    kinds = (ev.RequestCompleted, ev.RequestFailed, ev.RequestCancelled)
    return [e for e in lane.events(*kinds) if e.request_id == request_id]


@pytest.mark.parametrize("route", ["one model", "every model"])
@pytest.mark.parametrize("kind", ["durable", "sync"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
async def test_an_unload_under_a_running_request_leaves_the_lane_working(
    schedule: str, kind: str, route: str
) -> None:
    lane, sender = lane_for(schedule)
    first = await start_running(lane, sender, kind)
    unloaded = await lane.scheduler.unload("A" if route == "one model" else None)
    assert unloaded == ["A"]
    assert first.detached.result().code == "model_unloaded"
    await settle()
    rid = first.request_id
    if kind == "durable":
        # Put back on the same attempt and sent again, with a deadline armed.
        (requeued,) = lane.events(ev.RequestRequeued)
        assert (requeued.request_id, requeued.attempt) == (rid, 1)
        again = [t for t in sender.sent if t.request_id == rid]
        assert len(again) == 2 and again[1] is not first, "nobody sent the job again"
        assert again[1].ready.result(), "the fresh ticket has no upstream"
        due = [t for t in lane.clock.pending() if t.args[0] == rid]
        assert len(due) == 1, "the job runs again without its maxRunTime deadline"
        await lane.finish(again[1])
        assert isinstance(lane.ended(again[1]), ev.RequestCompleted)
    else:
        (failed,) = terminal(lane, rid)
        assert isinstance(failed, ev.RequestFailed) and failed.http_status == 503
    # A synchronous chat for the same model, then for another, is answered.
    for model in ("A", "B"):
        chat = lane.admit(model)
        await settle()
        assert chat.ready.done(), f"a chat for {model} waits behind the unloaded request"
        await lane.finish(chat)
    assert lane.scheduler.state.requests == {}
    assert [len(terminal(lane, e.request_id)) for e in lane.events(ev.RequestEnqueued)] == [1] * 3
    found = audit(enumerate((e for _, e in lane.store.events), start=1)).violations
    assert found == []


async def test_an_unload_under_a_running_job_and_a_sync_request_on_two_slots() -> None:
    lane, sender = lane_for("slots")
    job = await start_running(lane, sender, "durable")
    sync = await start_running(lane, sender, "sync")
    assert await lane.scheduler.unload(None) == ["A"]
    await settle()
    assert isinstance(terminal(lane, sync.request_id)[0], ev.RequestFailed)
    fresh = [t for t in sender.sent if t.request_id == job.request_id][-1]
    assert fresh is not job
    chat = lane.admit("B")  # needs A evicted: only once the job is done
    await settle()
    await lane.finish(fresh)
    await settle()
    assert chat.ready.done()
    await lane.finish(chat)
    assert lane.scheduler.state.requests == {}


async def test_a_job_put_back_with_nothing_to_send_it_fails_and_frees_the_lane() -> None:
    """No jobs layer registered (or a ticket without its job): the job cannot be
    sent again, so it fails (logged as the defect it is) instead of wedging."""
    lane = Lane(config_text({"A": {}, "B": {}}))
    job = lane.admit("A", durable=True)
    await settle()
    lane.scheduler.started(job.request_id)
    await lane.scheduler.unload("A")
    await settle()
    (failed,) = terminal(lane, job.request_id)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 500
    assert "nothing to send it" in failed.error
    chat = lane.admit("B")
    await settle()
    assert chat.ready.done()


async def test_a_dispatched_request_without_a_ticket_fails_instead_of_holding_the_lane() -> None:
    """The run loop's assertion: a request dispatched with no ticket (nobody to
    send it, nobody to arm its deadline) is a defect, ended at once."""
    lane = Lane(config_text({"A": {}, "B": {}}))
    blocker = lane.admit("A")
    orphan = lane.admit("A")
    await settle()
    del lane.scheduler.tickets[orphan.request_id]  # the defect, made on purpose
    await lane.finish(blocker)
    (failed,) = terminal(lane, orphan.request_id)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 500
    assert "was dispatched with nothing to send it" in failed.error
    chat = lane.admit("B")
    await settle()
    assert chat.ready.done()
