"""A ComfyUI server put to sleep by `POST /free` instead of stopped (`sleep:
comfyui`, issue 43), through `gpulane serve` in front of tools/fake_comfyui.py,
whose `/free` sets flags that its prompt worker acts on between prompts, as
ComfyUI's does. Its record file says when `/free` arrived (and what was
rendering then), when the models were freed and when a prompt loaded them
again, so each test reads what the server really went through."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.gateway import Gateway, fake_model, poll, records
from tests.e2e.test_lane import assert_log_sound
from tests.e2e.test_renders import history, rendering, workflow

Start = Callable[[str], Gateway]


def config(record: Path, gpu: Path | None = None, sleep: str = "comfyui") -> str:
    """ComfyUI (sleeping by /free) beside a chat model, one at a time on one GPU."""
    held = f" --gpu-dir {gpu} --gpu-mib 20000 --gpu-context-mib 500" if gpu else ""
    comfy = textwrap.dedent(
        f"""
          comfyui_auto:
            cmd: {sys.executable} -m tools.fake_comfyui --port ${{PORT}} --record {record}{held}
            checkEndpoint: /system_stats
            maxRunTime: 120
            unloadTimeout: 1
            sleep: {sleep}
        """
    )
    return "models:" + (comfy + fake_model("chat")).replace("\n", "\n  ") + "\n"


def chat(client: httpx.Client) -> httpx.Response:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    return client.post("/v1/chat/completions", json=body)


def prompt(client: httpx.Client, seconds: float) -> str:
    r = client.post("/comfyui/prompt", json={"prompt": workflow(seconds)})
    assert r.status_code == 200, r.text
    prompt_id: str = r.json()["prompt_id"]
    return prompt_id


def rendered(client: httpx.Client, prompt_id: str) -> None:
    entry = history(client, prompt_id).get(prompt_id)
    assert entry is not None and entry["status"]["status_str"] == "success", entry


def events(gw: Gateway, *types: str) -> list[tuple[str, dict[str, Any]]]:
    marks = ",".join("?" * len(types))
    rows = gw.sql(f"SELECT type, data FROM events WHERE type IN ({marks}) ORDER BY seq", *types)
    return [(r["type"], json.loads(r["data"])) for r in rows]


SWAPS = ("process_started", "process_sleeping", "process_slept", "process_woken")
SWAPS += ("sleep_skipped", "process_stopping", "process_stopped")


def story(gw: Gateway) -> list[str]:
    return [f"{kind} {data['model']}" for kind, data in events(gw, *SWAPS)]


def what(record: Path) -> list[str]:
    """The fake's record, as `event` (and the prompt rendering when /free came)."""
    out = []
    for r in records(record):
        extra = f" rendering={r['rendering']}" if r["event"] == "free_requested" else ""
        out.append(r["event"] + extra)
    return out


def held_mib(gpu: Path, pid: int) -> int:
    path = gpu / f"{pid}.json"
    return int(json.loads(path.read_text())["mib"]) if path.exists() else -1


def test_an_evicted_comfyui_sleeps_and_its_next_prompt_runs_on_the_same_process(
    tmp_path: Path,
) -> None:
    record, gpu = tmp_path / "comfy.jsonl", tmp_path / "gpu"
    gpu.mkdir()
    gw = Gateway(tmp_path, config(record, gpu))
    gw.env = {"GPULANE_FAKE_GPU": f"{gpu}:81920"}  # gpulane reads the fake GPU too
    try:
        gw.start()
        slept_and_woken(gw, record, gpu)
    finally:
        gw.stop()


def slept_and_woken(gw: Gateway, record: Path, gpu: Path) -> None:
    with gw.client() as client:
        first = prompt(client, 0.3)
        rendered(client, first)
        pid = records(record)[0]["pid"]
        assert held_mib(gpu, pid) == 20500  # the models, and its CUDA context
        assert chat(client).status_code == 200  # evicts ComfyUI: POST /free
        running = {r["model"]: r["state"] for r in client.get("/running").json()["running"]}
        assert running == {"comfyui_auto": "sleeping", "chat": "ready"}
        # Its process runs on, its models freed: only the context is left.
        poll(lambda: held_mib(gpu, pid) == 500, "ComfyUI's models to be freed")
        # Asleep, it still answers its side paths, and they wake nothing.
        r = client.get("/comfyui/object_info")
        assert r.status_code == 200 and "FakeRender" in r.json(), r.text
        assert not events(gw, "process_woken") and held_mib(gpu, pid) == 500
        second = prompt(client, 0.3)  # wakes it: the prompt loads the models again
        rendered(client, second)
        assert {r["pid"] for r in records(record)} == {pid}  # no cold start
        assert held_mib(gpu, pid) == 20500
    assert what(record) == [
        "render_started",
        "models_loaded",
        "render_ended",
        "free_requested rendering=None",
        "models_freed",
        "render_started",
        "models_loaded",
        "render_ended",
    ]
    gw.wait_for("SELECT 1 FROM events WHERE type = 'swap_finished'", count=3)
    assert story(gw) == [
        "process_started comfyui_auto",
        "process_sleeping comfyui_auto",
        "process_slept comfyui_auto",
        "process_started chat",
        "process_stopping chat",  # chat has no sleep: stopped for ComfyUI's wake
        "process_stopped chat",
        "process_woken comfyui_auto",
    ]
    woken = events(gw, "process_woken")[0][1]
    assert woken["pid"] == pid == events(gw, "process_started")[0][1]["pid"]
    assert_log_sound(gw)
    verified = subprocess.run(
        [sys.executable, "-m", "tools.replay", str(gw.db), "--verify"],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stdout


def test_eviction_wanted_mid_render_waits_for_the_render_then_sleeps(
    gateway: Start, tmp_path: Path
) -> None:
    """A held render holds its lane: the chat that wants ComfyUI's room waits
    for the render's end, and only then is `/free` sent (ComfyUI would act on
    it only between prompts, but the render's models would then be freed under
    a chat already loading)."""
    record = tmp_path / "comfy.jsonl"
    gw = gateway(config(record))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        render = prompt(client, 2.0)
        poll(lambda: rendering(record, render), "the render to start")
        pending = pool.submit(chat, client)
        assert pending.result(timeout=60).status_code == 200
        rendered(client, render)
    assert_log_sound(gw)  # first: every request ended, so the log before them is on disk
    assert what(record) == [
        "render_started",
        "models_loaded",
        "render_ended",
        "free_requested rendering=None",  # after the render, never inside it
        "models_freed",
    ]
    ended = next(r["at"] for r in records(record) if r["event"] == "render_ended")
    freed = next(r["at"] for r in records(record) if r["event"] == "free_requested")
    assert freed >= ended
    assert [kind for kind, _ in events(gw, "process_sleeping", "process_slept")] == [
        "process_sleeping",
        "process_slept",
    ]
    assert not [r for r in records(record) if r["event"] == "stopped_mid_render"]


def test_a_comfyui_that_hung_asleep_fails_its_wake_and_the_prompt_gets_a_new_one(
    gateway: Start, tmp_path: Path
) -> None:
    """ComfyUI has no wake call, so its wake asks `GET /system_stats`: a sleeper
    that stopped answering (here SIGSTOPped) is stopped and cold-started for the
    prompt, recorded, instead of the prompt being sent into it."""
    record = tmp_path / "comfy.jsonl"
    gw = gateway(config(record, sleep="{preset: comfyui, wakeTimeout: 1}"))
    with gw.client() as client:
        rendered(client, prompt(client, 0.1))
        assert chat(client).status_code == 200  # ComfyUI sleeps
        poll(lambda: events(gw, "process_slept"), "ComfyUI's sleep")
        hung = records(record)[0]["pid"]
        os.kill(hung, signal.SIGSTOP)
        try:
            second = prompt(client, 0.1)
            rendered(client, second)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)  # if it was not killed: let its stop end
    assert_log_sound(gw)  # first: every request ended, so the log before them is on disk
    pids = [r["pid"] for r in records(record) if r["event"] == "render_started"]
    assert pids[0] == hung and pids[1] != hung, pids
    skipped = events(gw, "sleep_skipped")
    assert [(d["action"], d["why"]) for _, d in skipped] == [
        ("wake", "the wake took more than its 1 s")
    ]
    assert [d["reason"] for _, d in events(gw, "process_stopped") if d["model"] == "comfyui_auto"][
        :1
    ] == ["wake_failed"]
