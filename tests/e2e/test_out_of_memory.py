"""A model server that runs out of GPU memory, end to end: a real `gpulane serve`
on a fake GPU shared by files (app/runtime/gpu_file.py), the memory router, and
fake upstreams that print the lines the real servers print. The waiting
request's error, the log and `gpulane explain` each say that it ran out of GPU
memory, with the line and who held the GPU; its next load puts its idle
neighbour away first, and explain says why (docs/scheduling.md, "A server out
of GPU memory")."""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.gateway import Gateway, poll
from tests.e2e.log_replay import assert_log_replays, gpulane

TOTAL_MIB = 81_920
# llama.cpp's lines when cudaMalloc fails (ggml/src/ggml-cuda/ggml-cuda.cu,
# src/llama-model.cpp), as tests/unit/test_out_of_memory.py quotes them.
CUDA_MALLOC = (
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 24576.00 MiB on device 0: "
    "cudaMalloc failed: out of memory"
)
MODEL_LOAD = "llama_model_load: error loading model: unable to allocate CUDA0 buffer"
# PyTorch's, raised in the middle of a request (c10/cuda/CUDACachingAllocator.cpp).
TORCH = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 79.10 GiB of which 1.06 GiB is free."
)

Start = Callable[..., tuple[Gateway, Path]]


def model(name: str, gpu: Path, mib: int, declared: str, *extra: str) -> str:
    """A fake upstream taking `mib` of the fake GPU, declaring `declared`; its
    cmd single-quoted in YAML, so the lines it prints may hold ': '."""
    args = [
        f"{sys.executable} -m tools.fake_upstream --port ${{PORT}} --name {name}",
        f"--gpu-dir {gpu} --gpu-mib {mib}",
        *extra,
    ]
    cmd = " ".join(args).replace("'", "''")
    return f"  {name}:\n    cmd: '{cmd}'\n    checkEndpoint: /health\n    gpuMemory: {declared}\n"


def config(gpu: Path) -> str:
    # B declares less than it needs, so the memory router keeps A beside it.
    failing = f'--fail-start-with "{CUDA_MALLOC}" --fail-start-with "{MODEL_LOAD}"'
    return (
        "loadBackoff: 60\n"
        "models:\n"
        + model("A", gpu, 60000, "60000MiB")
        + model("B", gpu, 0, "10GiB", failing)
        + ROUTING
    )


ROUTING = "routing:\n  router:\n    use: memory\n    settings:\n      memory: {budget: 80GiB}\n"


def beside_config(gpu: Path) -> str:
    # B takes 30000 MiB and declares 10 GiB: the memory router loads it beside A's
    # 60000, where it runs out of GPU memory; alone it fits.
    failing = f'--gpu-total {TOTAL_MIB} --fail-start-when-full "{CUDA_MALLOC}"'
    return (
        "loadBackoff: 1\n"
        "models:\n"
        + model("A", gpu, 60000, "60000MiB")
        + model("B", gpu, 30000, "10GiB", failing)
        + ROUTING
    )


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    started: list[Gateway] = []

    def run(make: Callable[[Path], str] = config) -> tuple[Gateway, Path]:
        gpu = tmp_path / "gpu"
        gpu.mkdir(exist_ok=True)
        gw = Gateway(tmp_path, make(gpu))
        gw.env = {"GPULANE_FAKE_GPU": f"{gpu}:{TOTAL_MIB}"}
        started.append(gw.start())
        return gw, gpu

    yield run
    for gw in started:
        gw.stop()


def chat(gw: Gateway, model: str, **fake: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)


def events(gw: Gateway, kind: str) -> list[dict[str, object]]:
    """The `kind` events on disk, once there is one (the log commits in groups)."""

    def read() -> list[dict[str, object]]:
        rows = gw.sql("SELECT data FROM events WHERE type = ? ORDER BY seq", kind)
        return [json.loads(r["data"]) for r in rows]

    return poll(read, f"a {kind} event")


def ended(gw: Gateway, request_id: str) -> list[sqlite3.Row]:
    query = "SELECT error, http_status FROM requests WHERE id = ? AND finished_at IS NOT NULL"
    return poll(lambda: gw.sql(query, request_id), f"request {request_id} recorded as ended")


def test_a_load_out_of_gpu_memory_says_so_everywhere(start: Start) -> None:
    gw, _ = start()
    assert chat(gw, "A").status_code == 200
    failed = chat(gw, "B")
    assert failed.status_code == 503, failed.text
    request_id = failed.headers["x-request-id"]
    error = failed.json()["error"]
    assert error["code"] == "upstream_out_of_memory"
    assert error["type"] == "service_unavailable"
    message = error["message"]
    assert message.startswith(
        f"model 'B' failed to start: its server ran out of GPU memory ({CUDA_MALLOC}). "
        "When it failed, 60000 of 81920 MiB of GPU memory were in use: 60000 MiB by model 'A'."
    ), message
    assert "gpuMemory" in message and "exited with code 1 during start" in message

    (swap_failed,) = events(gw, "swap_failed")
    assert swap_failed["out_of_memory"] == CUDA_MALLOC
    stopped = [e for e in events(gw, "process_stopped") if e["reason"] == "failed_start"]
    assert [e["out_of_memory"] for e in stopped] == [CUDA_MALLOC]
    (row,) = ended(gw, request_id)
    assert row["http_status"] == 503 and CUDA_MALLOC in row["error"]
    assert chat(gw, "A").status_code == 200  # A, still resident, serves on

    shown = gpulane("explain", request_id, "--db", str(gw.db))
    assert shown.returncode == 0, shown.stderr
    assert f"Its load of B failed: its server ran out of GPU memory ({CUDA_MALLOC})" in (
        shown.stdout
    ), shown.stdout
    story = json.loads(gpulane("explain", request_id, "--db", str(gw.db), "--json").stdout)
    assert story["own_swap"]["out_of_memory"] == CUDA_MALLOC
    gw.stop()
    checked = gw.db_check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert_log_replays(gw.db)


def test_a_server_dying_out_of_memory_mid_request_says_so(start: Start) -> None:
    gw, _ = start()
    assert chat(gw, "A").status_code == 200
    died = chat(gw, "A", die_with=TORCH)  # it dies at once; gpulane loads it, retries once
    assert died.status_code == 503, died.text
    request_id = died.headers["x-request-id"]
    error = died.json()["error"]
    assert error["code"] == "upstream_out_of_memory"
    assert error["message"].startswith(
        f"model 'A' ran out of GPU memory while serving this request: its server exited ({TORCH})."
    ), error["message"]
    crashed = poll(
        lambda: [e for e in events(gw, "process_stopped") if e["reason"] == "crashed"],
        "the crash recorded",
    )
    assert crashed[0]["out_of_memory"] == TORCH
    (row,) = ended(gw, request_id)
    assert row["http_status"] == 503 and TORCH in row["error"]
    assert chat(gw, "A").status_code == 200  # loaded again for the next request
    gw.stop()
    assert_log_replays(gw.db)


def test_its_next_load_puts_the_idle_neighbour_it_ran_out_beside_away_first(
    start: Start,
) -> None:
    gw, _ = start(beside_config)
    assert chat(gw, "A").status_code == 200
    failed = chat(gw, "B")  # beside A: 60000 + 30000 MiB do not fit 81920
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "upstream_out_of_memory"
    served = chat(gw, "B")  # after its 1 s back-off, alone
    assert served.status_code == 200, served.text
    request_id = served.headers["x-request-id"]

    def swaps(count: int) -> list[tuple[object, ...]]:
        found = [(e["to_model"], e["evicted"], e["ran_out"]) for e in events(gw, "swap_started")]
        return found if len(found) == count else []

    assert poll(lambda: swaps(3), "three swaps") == [
        ("A", [], None),
        ("B", [], None),
        ("B", ["A"], {"beside": ["A"], "loading": True}),
    ]
    # A's stop comes after the third swap's start: read once it is on disk too.
    stopped = poll(
        lambda: [e for e in events(gw, "process_stopping") if e["reason"] == "evicted"],
        "A's stop for B",
    )
    assert [(e["model"], e["evicted_for"]) for e in stopped] == [("A", "B")]
    # The load measured B (30000 MiB): the usual rule again, and A does not fit beside it.
    assert chat(gw, "A").status_code == 200
    assert poll(lambda: swaps(4), "four swaps")[-1] == ("A", ["B"], None)

    why = "B ran out of GPU memory at its last load beside A: A was put away first"
    shown = gpulane("explain", request_id, "--db", str(gw.db))
    assert shown.returncode == 0, shown.stderr
    assert why in shown.stdout, shown.stdout
    story = json.loads(gpulane("explain", request_id, "--db", str(gw.db), "--json").stdout)
    assert story["own_swap"]["evicted_because"] == why
    gw.stop()
    checked = gw.db_check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert_log_replays(gw.db)
