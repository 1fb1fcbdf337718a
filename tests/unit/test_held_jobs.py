"""Jobs that hold their model until their end is learnt (issue 40), as run-loop
units: the core's rule (a held model runs one job at a time, whatever its
concurrencyLimit; a job that holds it keeps it from eviction and TTL) and the
held runner (app/jobs/held.py) against a probe the test drives."""

from __future__ import annotations

import asyncio
from typing import Any

from app.core import events as ev
from app.jobs.held import PROGRESS_EVERY_S, HeldRuns, ProbeLost, Verdict, _Sampler
from app.runtime.api import Ticket
from app.runtime.parameters import server_started
from tests.unit.run_loop_fakes import Lane, config_text, settle

COMFY = {"kind": "comfyui", "concurrencyLimit": 50, "ttl": 2, "maxRunTime": 600}


def lane() -> Lane:
    return Lane(config_text({"comfy": COMFY, "chat": {}}))


class FakeProbe:
    """A server whose jobs end when the test says (`end`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.already: Verdict | None = None
        self.refusal: Verdict | None = None
        self.ends: dict[str, asyncio.Future[Verdict]] = {}

    def end(self, job_id: str, verdict: Verdict | BaseException) -> None:
        future = self.ends.setdefault(job_id, asyncio.get_running_loop().create_future())
        if isinstance(verdict, BaseException):
            future.set_exception(verdict)
        else:
            future.set_result(verdict)

    async def finished(self, base_url: str, job_id: str) -> Verdict | None:
        self.calls.append(("finished", job_id))
        return self.already

    async def submit(self, base_url: str, job: dict[str, Any], body: bytes) -> Verdict | None:
        self.calls.append(("submit", job["id"]))
        return self.refusal

    async def wait(self, base_url: str, job_id: str) -> Verdict:
        self.calls.append(("wait", job_id))
        future = self.ends.setdefault(job_id, asyncio.get_running_loop().create_future())
        return await future

    async def interrupt(self, base_url: str, job_id: str) -> None:
        self.calls.append(("interrupt", job_id))


class Sent:
    """Runs each held job as Jobs.run would: sent by the runner once ready."""

    def __init__(self, lane: Lane, probe: FakeProbe) -> None:
        self.lane = lane
        self.runs = HeldRuns(lane.scheduler, {"comfyui": probe})
        self.kept: dict[str, bytes] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def render(self) -> Ticket:
        ticket = self.lane.admit("comfy", durable=True)

        async def keep(status: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.kept[ticket.request_id] = body

        def ready(f: asyncio.Future[str]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            job = {"door": "comfyui", "id": ticket.request_id}
            send = self.runs.send(ticket, f.result(), job, b"{}", keep)
            task = asyncio.get_running_loop().create_task(send)
            self.tasks.append(task)
            self.lane.scheduler.supervise(ticket.request_id, task)

        ticket.ready.add_done_callback(ready)
        return ticket


def test_a_held_model_runs_one_job_whatever_its_concurrency_limit() -> None:
    config = lane().config
    state_event = server_started(config, 0, 0)
    assert state_event.held == ["comfy"]
    assert state_event.concurrency["comfy"] == 50


async def test_a_render_holds_its_model_until_the_probe_says_it_ended() -> None:
    lane_ = lane()
    probe = FakeProbe()
    sent = Sent(lane_, probe)
    first, second = sent.render(), sent.render()
    await settle()
    assert first.ready.done() and not second.ready.done(), "two renders at once on one model"
    assert probe.calls == [("finished", first.request_id), ("submit", first.request_id)] + [
        ("wait", first.request_id)
    ]
    chat = lane_.admit("chat")
    await lane_.clock.advance(30)  # TTL 2 s: never while the render holds the model
    assert lane_.events(ev.ProcessStopped) == [] and not chat.ready.done()
    probe.end(first.request_id, Verdict(ok=True, status=200, result=b'{"entry": 1}'))
    await settle()
    assert isinstance(lane_.ended(first), ev.RequestCompleted)
    assert sent.kept[first.request_id] == b'{"entry": 1}'
    assert second.ready.done() and not chat.ready.done()  # the next render, then the chat
    probe.end(second.request_id, Verdict(ok=False, status=500, error="ComfyUI: boom"))
    await settle()
    assert lane_.ended(second).error == "ComfyUI: boom"
    assert chat.ready.done()
    await lane_.finish(chat)


async def test_a_cancel_interrupts_the_render_and_frees_the_model_at_once() -> None:
    lane_ = lane()
    probe = FakeProbe()
    sent = Sent(lane_, probe)
    render = sent.render()
    chat = lane_.admit("chat")
    await settle()
    assert lane_.scheduler.cancel_any(render.request_id) == "running"
    await settle()
    assert ("interrupt", render.request_id) in probe.calls
    assert isinstance(lane_.ended(render), ev.RequestCancelled)
    assert chat.ready.done()


async def test_a_server_that_stops_answering_ends_the_render_once_as_failed() -> None:
    lane_ = lane()
    probe = FakeProbe()
    sent = Sent(lane_, probe)
    render = sent.render()
    await settle()
    probe.end(render.request_id, ProbeLost("ComfyUI stopped answering during the render"))
    await settle()
    failed = lane_.ended(render)
    assert isinstance(failed, ev.RequestFailed) and failed.http_status == 502


async def test_a_refused_render_and_one_the_server_had_finished() -> None:
    lane_ = lane()
    probe = FakeProbe()
    sent = Sent(lane_, probe)
    probe.refusal = Verdict(ok=False, status=400, error="ComfyUI refused the prompt (400)")
    refused = sent.render()
    await settle()
    assert lane_.ended(refused).http_status == 400
    probe.refusal = None
    probe.already = Verdict(ok=True, status=200, result=b"{}")
    taken = sent.render()
    await settle()
    assert isinstance(lane_.ended(taken), ev.RequestCompleted)
    assert ("submit", taken.request_id) not in probe.calls  # its result was taken, not re-run


async def test_an_unload_under_a_render_puts_it_back_and_sends_it_again() -> None:
    lane_ = lane()
    probe = FakeProbe()
    sent = Sent(lane_, probe)
    again: list[Ticket] = []
    lane_.scheduler.on_put_back(lambda ticket, job: again.append(ticket))
    render = sent.render()
    await settle()
    render.job = {"door": "comfyui"}
    await lane_.scheduler.unload("comfy")
    await settle()
    assert ("interrupt", render.request_id) in probe.calls
    assert [t.request_id for t in again] == [render.request_id]
    assert [e.request_id for e in lane_.events(ev.RequestRequeued)] == [render.request_id]


def test_a_jobs_progress_is_recorded_sampled_not_per_step() -> None:
    # A 1000-step render looked at once a second for 100 s (10 steps a look):
    # a record per tenth, not one per look; a slow one (1 step a look) records
    # at least every PROGRESS_EVERY_S; a reading that did not change, never.
    fast = _Sampler(0.0)
    recorded = [t for t in range(1, 101) if fast.due((10 * t, 1000), float(t))]
    assert recorded == list(range(10, 101, 10))
    slow = _Sampler(0.0)
    recorded = [t for t in range(1, 301) if slow.due((t, 1000), float(t))]
    assert recorded == [int(PROGRESS_EVERY_S) * k for k in range(1, 11)]
    same = _Sampler(0.0)
    assert same.due((500, 1000), 1.0) and not same.due((500, 1000), 100.0)
