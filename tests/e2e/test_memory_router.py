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
from typing import Any

import httpx
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays, gpulane

Start = Callable[[str], Gateway]


def config(size: str, models: str = "AB", settings: str = "") -> str:
    """Each of `models` a fake upstream declaring `size`, under the memory router
    with an 80GiB budget (`settings`: more of its settings)."""
    entries = "".join(fake_model(m) for m in models).replace("\n", "\n  ")
    entries = entries.replace(
        "checkEndpoint: /health", f"checkEndpoint: /health\n    gpuMemory: {size}"
    )
    return (
        "models:"
        + entries
        + """
routing:
  router:
    use: memory
    settings:
      memory: {budget: 80GiB"""
        + settings
        + "}\n"
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
        "models:" + models + "\nrouting:\n  router:\n    use: memory\n    settings:\n"
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


def chat(client: httpx.Client, model: str, **fake: object) -> str:
    """Send a chat to `model` (`fake`: how its fake upstream answers); its request id."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "fake": fake}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-request-id"]


def explained(gw: Gateway, request_id: str) -> dict[str, Any]:
    """`gpulane explain REQUEST_ID --json`, as a user runs it."""
    shown = gpulane("explain", request_id, "--db", str(gw.db), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)  # type: ignore[no-any-return]


def test_explain_counts_every_model_loaded_beside_the_last_swap(
    gateway: Start, tmp_path: Path
) -> None:
    """A and B fit together and stay loaded (C needs one of them gone). While a
    request on A holds the lane, one for C arrives, then one for A: A's wins by
    swap affinity (the default bonus), though B's load was the last swap.
    `explain` replays each decision as recorded and names that reason."""
    gw = gateway(config("30GiB", "ABC"))
    hold = tmp_path / "hold"
    with gw.client() as client, cf.ThreadPoolExecutor(3) as pool:
        chat(client, "A")
        chat(client, "B")  # loaded beside A
        held = pool.submit(chat, client, "A", hold_file=str(hold))
        queued = "SELECT id FROM requests WHERE model = ? AND status = ?"
        poll(lambda: gw.sql(queued, "A", "running"), "A running")
        to_c = pool.submit(chat, client, "C")
        poll(lambda: gw.sql(queued, "C", "queued"), "C queued")
        again = pool.submit(chat, client, "A")
        poll(lambda: len(gw.sql(queued, "A", "queued")) == 1, "the second A queued")
        hold.touch()
        held_id, c_id, a_id = (f.result(timeout=60) for f in (held, to_c, again))
    poll(lambda: not gw.sql("SELECT 1 FROM requests WHERE finished_at IS NULL"), "all recorded")
    assert loads(gw) == ["A", "B", "C"]
    started = gw.sql("SELECT id FROM requests ORDER BY started_at")
    assert [r["id"] for r in started][2:] == [held_id, a_id, c_id]  # A overtook C

    story = explained(gw, c_id)
    assert story["replay_matches"] is True, story
    overtaken = story["decisions"][0]
    assert (overtaken["winner_id"], overtaken["reason"]) == (a_id, "swap_affinity"), story
    assert overtaken["matches_record"] is True
    assert [a["reason"] for a in story["ahead"]] == ["swap_affinity"], story
    assert explained(gw, a_id)["replay_matches"] is True
    gw.stop()
    assert_log_replays(gw.db)
