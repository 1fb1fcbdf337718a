"""The memory router end to end: a real `gpulane serve` over two fake upstreams
that declare their GPU memory. When both fit the budget, a mixed run loads each
once and swaps neither again, and still runs one job at a time; when they do
not fit, every change of model is a swap, as with one model at a time. Either
way `replay --verify` reproduces every decision (docs/scheduling.md, GPU memory),
and `explain` of every request does too, counting each model loaded beside the
last swap (with the default swapAffinityBonus; docs/queries.md, How explain works)."""

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


def config(size: str, models: str = "AB", settings: str = "", *, sleep: bool = False) -> str:
    """Each of `models` a fake upstream declaring `size`, under the memory router
    with an 80GiB budget (`settings`: more of its settings); `sleep`: fake vLLM
    servers that an eviction puts to sleep (tools/fake_sleeper.py)."""
    entries = "".join(fake_model(m) for m in models).replace("\n", "\n  ")
    more = f"gpuMemory: {size}"
    if sleep:
        entries = entries.replace("tools.fake_upstream", "tools.fake_sleeper")
        more += "\n    sleep: vllm"
    entries = entries.replace("checkEndpoint: /health", f"checkEndpoint: /health\n    {more}")
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


def overtake(gw: Gateway, hold: Path, running: str, loser: str, winner: str) -> tuple[str, str]:
    """While a request on `running` holds the lane (until `hold` exists), one for
    `loser` queues, then one for `winner`; then the lane is let go. Their ids."""
    queued = "SELECT id FROM requests WHERE model = ? AND status = ?"
    with gw.client() as client, cf.ThreadPoolExecutor(3) as pool:
        held = pool.submit(chat, client, running, hold_file=str(hold))
        poll(lambda: gw.sql(queued, running, "running"), f"{running} running")
        first = pool.submit(chat, client, loser)
        poll(lambda: gw.sql(queued, loser, "queued"), f"{loser} queued")
        second = pool.submit(chat, client, winner)
        poll(lambda: gw.sql(queued, winner, "queued"), f"{winner} queued")
        hold.touch()
        held_id, loser_id, winner_id = (f.result(timeout=60) for f in (held, first, second))
    poll(lambda: not gw.sql("SELECT 1 FROM requests WHERE finished_at IS NULL"), "all recorded")
    started = [r["id"] for r in gw.sql("SELECT id FROM requests ORDER BY started_at")]
    assert started[-3:] == [held_id, winner_id, loser_id]  # the later one overtook
    return loser_id, winner_id


def assert_overtaken_by_affinity(gw: Gateway, loser_id: str, winner_id: str) -> None:
    """`explain` of the overtaken request replays each decision as recorded and
    says the winner's model was loaded (swap affinity), and so for the winner."""
    story = explained(gw, loser_id)
    assert story["replay_matches"] is True, story
    overtaken = story["decisions"][0]
    assert (overtaken["winner_id"], overtaken["reason"]) == (winner_id, "swap_affinity"), story
    assert overtaken["matches_record"] is True
    assert [a["reason"] for a in story["ahead"]] == ["swap_affinity"], story
    assert explained(gw, winner_id)["replay_matches"] is True


def test_explain_counts_every_model_loaded_beside_the_last_swap(
    gateway: Start, tmp_path: Path
) -> None:
    """A and B fit together and stay loaded (C needs one of them gone). While a
    request on A holds the lane, one for C arrives, then one for A: A's wins by
    swap affinity (the default bonus), though B's load was the last swap.
    `explain` replays each decision as recorded and names that reason."""
    gw = gateway(config("30GiB", "ABC"))
    with gw.client() as client:
        chat(client, "A")
        chat(client, "B")  # loaded beside A
    loser, winner = overtake(gw, tmp_path / "hold", "A", "C", "A")
    assert loads(gw) == ["A", "B", "C"]
    assert_overtaken_by_affinity(gw, loser, winner)
    gw.stop()
    assert_log_replays(gw.db)


def slept(gw: Gateway, count: int) -> list[str]:
    """The models put to sleep, in order, once there are `count` of them."""
    query = "SELECT model FROM events WHERE type = 'process_slept' ORDER BY seq"
    rows = poll(lambda: (found := gw.sql(query)) and len(found) >= count and found, "a sleep")
    return [r["model"] for r in rows]


def test_explain_under_the_memory_router_a_slept_model_is_not_loaded_a_woken_one_is(
    gateway: Start, tmp_path: Path
) -> None:
    """Sleepers (issue 43) under the memory router: C's load puts X (A or B) to
    sleep and leaves Y loaded, so a later request for Y overtakes one for X by
    swap affinity; X's load wakes it and puts W to sleep, so a later request for
    X overtakes one for W. `explain` counts the slept model out and the woken
    one in, and replays every decision as recorded."""
    gw = gateway(config("30GiB", "ABC", sleep=True))
    with gw.client() as client:
        for model in "ABC":
            chat(client, model)
    (x,) = slept(gw, 1)
    (y,) = {"A", "B"} - {x}
    loser, winner = overtake(gw, tmp_path / "hold1", "C", x, y)
    assert_overtaken_by_affinity(gw, loser, winner)
    w = slept(gw, 2)[1]  # put to sleep by x's wake
    assert gw.sql("SELECT 1 FROM events WHERE type = 'process_woken' AND model = ?", x)
    loser, winner = overtake(gw, tmp_path / "hold2", x, w, x)
    assert_overtaken_by_affinity(gw, loser, winner)
    assert not gw.sql("SELECT 1 FROM events WHERE type = 'process_stopping'")  # slept, not stopped
    gw.stop()
    assert_log_replays(gw.db)


GROUPS = """models:
{models}
routing:
  router:
    use: group
    settings:
      groups:
        gpu0: {{swap: true, exclusive: false, members: [A]}}
        gpu1: {{swap: true, exclusive: false, members: [B]}}
"""


@pytest.mark.parametrize(
    "router",
    ["memory", "memory sideBySide", "two groups"],
)
def test_explain_of_a_b_a_counts_a_as_loaded(gateway: Start, router: str) -> None:
    """A, then B loaded beside it, then A again: the last request's decision
    gives it the swap-affinity bonus, and `explain` replays it as recorded,
    under the memory router (one lane or side by side) and in two lanes."""
    if router == "two groups":
        text = GROUPS.format(models=(fake_model("A") + fake_model("B")).replace("\n", "\n  "))
    else:
        text = config("30GiB", "AB", ", sideBySide: true" if "sideBySide" in router else "")
    gw = gateway(text)
    with gw.client() as client:
        ids = [chat(client, model) for model in "ABA"]
    poll(lambda: not gw.sql("SELECT 1 FROM requests WHERE finished_at IS NULL"), "all recorded")
    assert loads(gw) == ["A", "B"]
    story = explained(gw, ids[-1])
    assert story["replay_matches"] is True, story
    (own,) = story["decisions"]
    assert own["matches_record"] is True and own["score"]["affinity"] > 0, story
    gw.stop()
    assert_log_replays(gw.db)
