"""GPU memory end to end, on a fake GPU shared by files (app/runtime/gpu_file.py):
`gpulane serve` reads it as it would NVML, and each fake upstream takes its
memory at start and gives it back at its exit, now, later or never. Footprints
are measured by pid and recorded, `/metrics` shows the GPU, and a load waits
for a stopped model's memory: it goes on once the memory is back, and fails
with the holder's pid and model when it never is (docs/scheduling.md, GPU memory)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays

TOTAL_MIB = 81_920
Start = Callable[..., tuple[Gateway, Path]]


def config(release_after: str, wait_s: float, gpu: Path) -> str:
    models = (
        fake_model("A", f"--gpu-dir {gpu} --gpu-mib 60000 --gpu-release-after {release_after}")
        + fake_model("B", f"--gpu-dir {gpu} --gpu-mib 30000")
    ).replace("\n", "\n  ")
    return f"memoryReleaseWait: {wait_s}\nmodels:" + models + "\n"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    started: list[Gateway] = []

    def run(release_after: str, wait_s: float = 10) -> tuple[Gateway, Path]:
        gpu = tmp_path / "gpu"
        gpu.mkdir(exist_ok=True)
        gw = Gateway(tmp_path, config(release_after, wait_s, gpu))
        gw.env = {"GPULANE_FAKE_GPU": f"{gpu}:{TOTAL_MIB}"}
        started.append(gw.start())
        return gw, gpu

    yield run
    for gw in started:
        gw.stop()


def chat(gw: Gateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)


def events(gw: Gateway, kind: str) -> list[dict[str, object]]:
    """The `kind` events on disk, once there is one: an answer can reach the
    client before its events are committed (the log's group commit)."""

    def read() -> list[dict[str, object]]:
        rows = gw.sql("SELECT data FROM events WHERE type = ? ORDER BY seq", kind)
        return [json.loads(r["data"]) for r in rows]

    return poll(read, f"a {kind} event")


def test_a_load_waits_for_the_memory_a_stopped_model_frees_late(start: Start) -> None:
    gw, _ = start("2")
    assert chat(gw, "A").status_code == 200
    pid_a = events(gw, "process_started")[0]["pid"]
    assert events(gw, "swap_finished")[0]["gpu_memory_mib"] == 60000  # measured by its pid
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'gpulane_gpu_memory_used_bytes{gpu="0",name="fake GPU (files)"} 6.291456e+10' in metrics
    assert 'gpulane_model_gpu_memory_bytes{model="A"} 6.291456e+10' in metrics
    assert chat(gw, "B").status_code == 200  # A stops; its memory is back 2 s after its exit
    poll(lambda: events(gw, "swap_finished")[1:], "B's load recorded")
    (began,) = events(gw, "memory_wait_started")
    assert began["model"] == "B" and began["holders"] == [
        {"pid": pid_a, "model": "A", "mib": 60000}
    ]
    (ended,) = events(gw, "memory_wait_ended")
    assert ended["released"] is True and 1000 <= ended["waited_ms"] <= 10_000
    assert events(gw, "process_stopping")[0]["gpu_memory_mib"] == 60000
    gw.stop()
    checked = gw.db_check()  # the waits are sound to `db check`, and replay verifies
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert_log_replays(gw.db)


def test_memory_never_released_fails_the_requests_naming_the_holder(start: Start) -> None:
    gw, gpu = start("never", wait_s=1)
    assert chat(gw, "A").status_code == 200
    pid_a = events(gw, "process_started")[0]["pid"]
    failed = chat(gw, "B")
    assert failed.status_code == 502
    text = failed.text
    assert f"GPU memory was not released: pid {pid_a} (model 'A') still holds 60000 MiB" in text
    events(gw, "swap_failed")  # the failed load recorded
    (ended,) = events(gw, "memory_wait_ended")
    assert ended["released"] is False
    # The lane moves on: once the driver lets go, the next request is served.
    (gpu / f"{pid_a}.json").unlink()
    assert chat(gw, "A").status_code == 200
