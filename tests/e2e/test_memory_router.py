"""The memory router end to end: a real `gpulane serve` over two fake upstreams
that declare their GPU memory. When both fit the budget, a mixed run loads each
once and swaps neither again, and still runs one job at a time; when they do
not fit, every change of model is a swap, as with one model at a time. Either
way `replay --verify` reproduces every decision (docs/scheduling.md, GPU memory)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays

Start = Callable[[str], Gateway]


def config(size: str) -> str:
    models = (fake_model("A") + fake_model("B")).replace("\n", "\n  ")
    models = models.replace(
        "checkEndpoint: /health", f"checkEndpoint: /health\n    gpuMemory: {size}"
    )
    return (
        "models:"
        + models
        + """
routing:
  scheduler:
    use: serial
    settings:
      serial: {swapAffinityBonus: 0}
  router:
    use: memory
    settings:
      memory: {budget: 80GiB}
"""
    )


def mixed_run(gw: Gateway) -> None:
    """A B A B A B A B, four at a time, each a short job."""
    body = {"messages": [{"role": "user", "content": "hi"}], "fake": {"delay": 0.2}}
    with gw.client() as client, cf.ThreadPoolExecutor(4) as pool:
        answers = [
            pool.submit(client.post, "/v1/chat/completions", json={"model": m, **body})
            for m in "ABABABAB"
        ]
        assert [a.result(timeout=60).status_code for a in answers] == [200] * 8
    poll(lambda: not gw.sql("SELECT 1 FROM requests WHERE finished_at IS NULL"), "all recorded")


def one_job_at_a_time(gw: Gateway) -> None:
    rows = gw.sql("SELECT started_at, finished_at FROM requests ORDER BY started_at")
    for before, after in zip(rows, rows[1:], strict=False):
        assert before["finished_at"] <= after["started_at"], (before, after)


def loads(gw: Gateway) -> list[str]:
    return [
        json.loads(r["data"])["to_model"]
        for r in gw.sql("SELECT data FROM events WHERE type = 'swap_started' ORDER BY seq")
    ]


@pytest.mark.parametrize(
    ("size", "swapped"),
    [("30GiB", False), ("50GiB", True)],
    ids=["fit together", "do not fit"],
)
def test_models_that_fit_stay_loaded_and_run_one_job_at_a_time(
    gateway: Start, size: str, swapped: bool
) -> None:
    gw = gateway(config(size))
    mixed_run(gw)
    one_job_at_a_time(gw)
    if swapped:
        assert len(loads(gw)) > 2  # every change of model reloads one
        assert gw.sql("SELECT 1 FROM events WHERE type = 'process_stopping'")
    else:
        assert sorted(loads(gw)) == ["A", "B"]  # each loaded once, neither swapped again
        assert not gw.sql("SELECT 1 FROM events WHERE type = 'process_stopping'")
    started = json.loads(gw.sql("SELECT data FROM events WHERE type = 'server_started'")[0]["data"])
    assert started["router"]["type"] == "memory"
    assert started["router"]["declared_mib"] == {
        "A": int(size[:2]) * 1024,
        "B": int(size[:2]) * 1024,
    }
    gw.stop()
    checked = gw.db_check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert_log_replays(gw.db)


def test_measured_footprints_let_models_share_and_are_known_after_a_restart(
    tmp_path: Path,
) -> None:
    """No model declares its size: each loads alone once, is measured (a fake GPU
    shared by files), and from then on both stay loaded; a restart records the
    sizes the log measured in its server_started."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    models = (
        fake_model("A", f"--gpu-dir {gpu} --gpu-mib 30000")
        + fake_model("B", f"--gpu-dir {gpu} --gpu-mib 30000")
    ).replace("\n", "\n  ")
    text = (
        "models:"
        + models
        + "\nrouting:\n  scheduler:\n    use: serial\n    settings:\n      serial: "
        "{swapAffinityBonus: 0}\n  router:\n    use: memory\n    settings:\n"
        "      memory: {budget: 80GiB}\n"
    )
    gw = Gateway(tmp_path, text)
    gw.env = {"GPULANE_FAKE_GPU": f"{gpu}:81920"}
    try:
        gw.start()
        body = {"messages": [{"role": "user", "content": "hi"}]}
        with gw.client() as client:
            for model in "ABABAB":
                r = client.post("/v1/chat/completions", json={"model": model, **body})
                assert r.status_code == 200
        poll(
            lambda: len(gw.sql("SELECT 1 FROM requests WHERE finished_at IS NOT NULL")) == 6,
            "all recorded",
        )
        # A alone (unknown), B alone (unknown: A goes), then A beside B for good.
        assert loads(gw) == ["A", "B", "A"]
        gw.stop()
        gw.start()
        rows = gw.sql("SELECT data FROM events WHERE type = 'server_started' ORDER BY seq")
        router = json.loads(rows[-1]["data"])["router"]
        assert router["measured_mib"] == {"A": 30000, "B": 30000}
    finally:
        gw.stop()
    assert_log_replays(gw.db)
