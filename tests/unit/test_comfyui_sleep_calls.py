"""ComfyUI's sleep calls as gpulane sends them (`sleep: comfyui`): `POST /free`
answers before anything is freed, since ComfyUI's prompt worker acts on its
flags between prompts; the sleep ends only once ComfyUI's queue is idle."""

from __future__ import annotations

import json

import httpx
import pytest

from app.config import parse_config
from app.config.sleep import SleepSpec
from app.runtime.sleepers import SleepError, _call_all

CONFIG = "models:\n  c:\n    cmd: comfy --port ${PORT}\n    kind: comfyui\n    sleep: comfyui\n"


def spec() -> SleepSpec:
    found = parse_config(CONFIG, environ={}).models["c"].sleep
    assert found is not None
    return found


class Comfy:
    """ComfyUI's answers: /free sets flags (200, no body); /queue lists a prompt
    as running for `busy_reads` reads, then nothing."""

    def __init__(self, busy_reads: int, queue_text: str | None = None) -> None:
        self.busy_reads = busy_reads
        self.queue_text = queue_text
        self.seen: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/free":
            assert json.loads(request.content) == {"unload_models": True, "free_memory": True}
            return httpx.Response(200)
        if request.url.path == "/queue":
            if self.queue_text is not None:
                return httpx.Response(200, text=self.queue_text)
            running = [[0, "someone-elses", {}, {}, []]] if self.busy_reads > 0 else []
            self.busy_reads -= 1
            return httpx.Response(200, json={"queue_running": running, "queue_pending": []})
        if request.url.path == "/system_stats":
            return httpx.Response(200, json={"system": {}, "devices": []})
        return httpx.Response(404)


async def test_the_sleep_waits_until_comfyui_runs_nothing() -> None:
    comfy, sleep = Comfy(busy_reads=2), spec()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy)) as client:
        await _call_all(client, "http://comfy", sleep.sleep, sleep.check, True, sleep.idle)
    assert comfy.seen == ["POST /free", "GET /queue", "GET /queue", "GET /queue"]


async def test_the_wake_only_asks_that_it_answers() -> None:
    comfy, sleep = Comfy(busy_reads=5), spec()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy)) as client:
        await _call_all(client, "http://comfy", sleep.wake, sleep.check, False)
    assert comfy.seen == ["GET /system_stats"]  # the next prompt loads the models


async def test_a_queue_answer_that_is_not_comfyuis_fails_the_sleep() -> None:
    comfy, sleep = Comfy(busy_reads=0, queue_text="<html>"), spec()
    async with httpx.AsyncClient(transport=httpx.MockTransport(comfy)) as client:
        with pytest.raises(SleepError, match="GET /queue answered '<html>'"):
            await _call_all(client, "http://comfy", sleep.sleep, sleep.check, True, sleep.idle)
