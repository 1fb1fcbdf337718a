"""A load whose server ran out of GPU memory, in the run loop (the real
`Scheduler`, a fake clock, recording fake upstreams and a fake GPU): its
requests fail 503 saying so, with who held the GPU, however they end (the load
they joined, or the load failure limit), and the log has the line
(app/runtime/out_of_memory.py, docs/scheduling.md "A server out of GPU memory")."""

from __future__ import annotations

import json

from app.core import events as ev
from app.runtime.gpu import FakeGpu, GpuMemory
from app.runtime.upstream import UpstreamStartError
from tests.unit.run_loop_fakes import Lane, config_text, settle

# SGLang's line (python/sglang/srt/model_executor/model_runner.py).
LINE = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."


def config(**settings: object) -> str:
    models = {"A": {}, "B": {}}
    return json.dumps(json.loads(config_text(models)) | settings)


async def test_a_load_out_of_memory_fails_its_requests_503_naming_the_line_and_the_holders() -> (
    None
):
    lane = Lane(config(loadFailureLimit=1), auto_load=False)
    gpu = FakeGpu(81920)
    gpu.take(999_999, 20000)  # a process gpulane did not start
    lane.scheduler.swaps.gpu = GpuMemory(gpu)
    first = lane.admit("A")
    second = lane.admit("A")  # waits behind the first's load; the limit fails it
    await settle()
    upstream = lane.upstreams.last("A")
    upstream.out_of_memory = LINE
    upstream.fail("exited with code 1 during start")
    await settle()

    (failed,) = lane.events(ev.SwapFailed)
    assert failed.out_of_memory == LINE
    assert failed.error.startswith(
        f"its server ran out of GPU memory ({LINE}). When it failed, 20000 of 81920 MiB of "
        "GPU memory were in use: 20000 MiB by processes gpulane did not start."
    ), failed.error
    assert failed.error.endswith("exited with code 1 during start")
    (stopped,) = lane.events(ev.ProcessStopped)
    assert (stopped.reason, stopped.out_of_memory) == ("failed_start", LINE)
    for ticket in (first, second):
        end = lane.ended(ticket)
        assert end.http_status == 503 and LINE in end.error
        error = ticket.ready.exception()
        assert isinstance(error, UpstreamStartError) and error.out_of_memory == LINE
    assert "loadFailureLimit 1" in lane.ended(second).error


async def test_a_load_that_failed_otherwise_stays_502_and_says_nothing_of_memory() -> None:
    lane = Lane(config(), auto_load=False)
    ticket = lane.admit("A")
    await settle()
    lane.upstreams.last("A").fail("exited with code 3 during start")
    await settle()
    assert lane.events(ev.SwapFailed)[0].out_of_memory is None
    end = lane.ended(ticket)
    assert end.http_status == 502 and "memory" not in end.error


async def test_a_crash_out_of_memory_is_recorded_with_its_line() -> None:
    lane = Lane(config())
    ticket = lane.admit("A")
    await settle()
    assert ticket.ready.done()
    upstream = lane.upstreams.last("A")
    upstream.out_of_memory = LINE
    upstream.crash(1)
    await settle()
    (crashed,) = lane.events(ev.ProcessStopped)
    assert (crashed.reason, crashed.out_of_memory) == ("crashed", LINE)
    assert await lane.scheduler.died_out_of_memory(upstream) == LINE
    upstream.out_of_memory = None
    assert await lane.scheduler.died_out_of_memory(upstream) is None
