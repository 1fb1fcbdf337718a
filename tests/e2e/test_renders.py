"""Renders that run in the background hold their model until they end (issue 40).

The real server in front of tools/fake_comfyui.py (a real process that renders
in a worker thread, as ComfyUI does) and tools/fake_upstream.py for chats. The
fake appends a line per render start and end to a record file, and one when
SIGTERM arrives mid-render, so each test reads what the server really went
through: renders that overlapped, a server stopped inside a render.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.e2e.gateway import (
    Gateway,
    fake_model,
    half_done,
    poll,
    progress_events,
    records,
    wait_for,
)
from tests.e2e.log_replay import assert_log_replays

Start = Callable[[str], Gateway]


def comfy_config(
    record: Path,
    *,
    concurrency: int = 50,
    extra: str = "",
    keys: str = "",
    output: Path | None = None,
) -> str:
    """ComfyUI as llama-swap names it (`comfyui_auto`, with llama-swap's raised
    concurrencyLimit) beside a chat model, one at a time on one GPU; with
    `output`, its output folder, which gpulane serves while it is not loaded."""
    written = f" --output {output}" if output is not None else ""
    comfy = textwrap.dedent(
        f"""
          comfyui_auto:
            cmd: {sys.executable} -m tools.fake_comfyui --port ${{PORT}} --record {record}{written}
            checkEndpoint: /system_stats
            concurrencyLimit: {concurrency}
            maxRunTime: 120
        """
    )
    if output is not None:
        comfy += f"  outputDir: {output}\n"
    entries = (comfy + fake_model("chat") + extra).replace("\n", "\n  ")
    return keys + "models:" + entries + "\n"


def workflow(seconds: float = 2.0, **inputs: Any) -> dict[str, Any]:
    return {
        "1": {"class_type": "FakeRender", "inputs": {"seconds": seconds, "steps": 20} | inputs},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}},
    }


def rendering(record: Path, prompt_id: str) -> bool:
    return any(
        r["event"] == "render_started" and r["prompt_id"] == prompt_id for r in records(record)
    )


def ends(record: Path) -> list[dict[str, Any]]:
    return [r for r in records(record) if r["event"] == "render_ended"]


def overlaps(record: Path) -> list[str]:
    """Renders that started while another ran in the same process."""
    running: dict[int, str] = {}
    found = []
    for r in records(record):
        if r["event"] == "render_started":
            if r["pid"] in running:
                found.append(f"{r['prompt_id']} started inside {running[r['pid']]}")
            running[r["pid"]] = r["prompt_id"]
        elif r["event"] == "render_ended":
            running.pop(r["pid"], None)
    return found


def queued(client: httpx.Client, seconds: float) -> str:
    """The prompt id of a `seconds` render queued through gpulane."""
    prompt_id: str = client.post("/comfyui/prompt", json={"prompt": workflow(seconds)}).json()[
        "prompt_id"
    ]
    return prompt_id


def history(client: httpx.Client, prompt_id: str, timeout: float = 30) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: client.get(f"/comfyui/history/{prompt_id}").json(), timeout=timeout
    )
    return found


def chat(model: str = "chat") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_mid_render_waits_for_its_end_and_never_stops_the_render(
    gateway: Start, tmp_path: Path
) -> None:
    """Issue 40's measurement, repeated: a 3 s render, a chat for another model
    1 s into it. The chat waits for the render's end (the render's server is not
    evicted mid-render), the render completes, and its history is served through
    gpulane after its server was swapped out."""
    record = tmp_path / "renders.jsonl"
    output = tmp_path / "output"
    output.mkdir()
    gw = gateway(comfy_config(record, output=output))
    # The render's last step waits for the test: a fixed render could end before
    # the chat arrives on a slow host.
    release = tmp_path / "release"
    prompt = workflow(3.0, hold_file=str(release))
    with gw.client() as client, cf.ThreadPoolExecutor(1) as pool:
        r = client.post("/comfyui/prompt", json={"prompt": prompt, "client_id": "c1"})
        assert r.status_code == 200, r.text
        # At once, not at the render's end (which waits for the test: no clock needed).
        assert not ends(record), "the prompt was answered once its render ended"
        doc = r.json()
        prompt_id = doc["prompt_id"]
        assert set(doc) == {"prompt_id", "number", "node_errors"} and doc["node_errors"] == {}
        assert wait_for(lambda: rendering(record, prompt_id)), "the render never started"
        assert client.get(f"/comfyui/history/{prompt_id}").json() == {}  # still running
        queue = client.get("/comfyui/queue").json()
        assert [item[1] for item in queue["queue_running"]] == [prompt_id]
        pending = pool.submit(client.post, "/v1/chat/completions", json=chat())
        try:
            # Released once the chat has waited over a second behind it.
            poll(
                lambda: [
                    w for w in client.get("/api/queue").json()["waiting"] if w["waited_s"] > 1.2
                ],
                "the chat to wait behind the render",
            )
        finally:
            release.touch()
        answer = pending.result(timeout=60)
        assert answer.status_code == 200, answer.text
        chat_done = time.time()
        ended = ends(record)
        assert [(e["prompt_id"], e["outcome"]) for e in ended] == [(prompt_id, "success")]
        assert ended[0]["at"] <= chat_done, "the chat was answered before the render ended"
        assert not [r for r in records(record) if r["event"] == "stopped_mid_render"]
        # ComfyUI was swapped out for the chat: its history still answers, from gpulane.
        assert wait_for(lambda: client.get("/running").json()["running"][0]["model"] == "chat")
        entry = history(client, prompt_id)[prompt_id]
        assert entry["status"]["status_str"] == "success"
        assert entry["outputs"]["2"]["images"][0]["filename"].endswith(".png")
        assert prompt_id in client.get("/comfyui/history").json()
        # Its image too, from ComfyUI's output folder, and nothing else there.
        image = entry["outputs"]["2"]["images"][0]["filename"]
        r = client.get(f"/comfyui/view?filename={image}&type=output&subfolder=")
        assert r.status_code == 200 and r.content == (output / image).read_bytes()
        (output / "other.png").write_bytes(b"not a kept output")
        for name in ("other.png", f"../output/{image}", "../renders.jsonl"):
            assert client.get(f"/comfyui/view?filename={name}").status_code == 404, name
        # Other ComfyUI paths never load it: 409 naming what would.
        r = client.get("/comfyui/object_info")
        assert r.status_code == 409 and "POST /comfyui/prompt" in r.json()["error"]["message"]
        # Explain says what the chat waited for: the render, for its real length.
        explained = client.get(f"/api/requests/{answer.headers['x-request-id']}/explain").json()
        (behind,) = explained["running_at_arrival"]
        assert (behind["request_id"], behind["model"], behind["render"]) == (
            prompt_id,
            "comfyui_auto",
            True,
        )
        assert behind["held_s"] > 1.0, behind
    events = [
        json.loads(row["data"]) | {"type": row["type"]}
        for row in gw.sql(
            "SELECT type, data FROM events WHERE request_id=? ORDER BY seq", prompt_id
        )
    ]
    kinds = [e["type"] for e in events]
    assert kinds.count("request_completed") == 1 and "request_failed" not in kinds
    completed = next(e for e in events if e["type"] == "request_completed")
    assert completed["run_ms"] >= 2500, "the render's run is not its real length"
    # The console's timeline draws a request from its dispatch to its end.
    (row,) = gw.sql("SELECT dispatched_at, finished_at FROM requests WHERE id=?", prompt_id)
    assert row["finished_at"] - row["dispatched_at"] >= 2.5, dict(row)
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    assert_log_replays(gw.db)


def test_renders_never_overlap_on_one_lane_whatever_concurrency_limit_says(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record, concurrency=50))
    with gw.client() as client:
        ids = [queued(client, 0.6) for _ in range(4)]
        for prompt_id in ids:
            assert history(client, prompt_id)[prompt_id]["status"]["completed"] is True
    assert overlaps(record) == []
    started = [r["prompt_id"] for r in records(record) if r["event"] == "render_started"]
    assert sorted(started) == sorted(ids)
    # gpulane held each render's lane from its start to its end: one at a time.
    # (ComfyUI's history can say the last ended before its event is on disk.)
    spans = gw.wait_for(
        "SELECT request_id, type FROM events WHERE type IN ('request_started', "
        "'request_completed') ORDER BY seq",
        count=8,
    )
    assert [r["type"] for r in spans] == ["request_started", "request_completed"] * 4


def test_cancel_and_interrupt_a_waiting_and_a_running_prompt(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    with gw.client() as client:
        running = queued(client, 30)
        waiting = queued(client, 30)
        given = client.post(
            "/comfyui/prompt", json={"prompt": workflow(30), "prompt_id": "mine-1"}
        ).json()["prompt_id"]
        assert given == "mine-1"
        assert wait_for(lambda: rendering(record, running))
        queue = client.get("/comfyui/queue").json()
        assert [i[1] for i in queue["queue_pending"]] == [waiting, given]
        # ComfyUI's own cancels: a waiting prompt deleted, the running one interrupted.
        assert client.post("/comfyui/queue", json={"delete": [waiting]}).status_code == 200
        assert client.post("/comfyui/interrupt", json={}).status_code == 200
        ended = wait_for(lambda: ends(record))
        assert [(e["prompt_id"], e["outcome"]) for e in ended] == [(running, "interrupted")]
        # gpulane's own cancel of the next one, once it renders.
        assert wait_for(lambda: rendering(record, given))
        assert client.delete(f"/api/requests/{given}").status_code == 200
        assert wait_for(lambda: len(ends(record)) == 2)
        for prompt_id in (running, waiting, given):
            entry = history(client, prompt_id)[prompt_id]
            assert entry["status"]["status_str"] == "error", entry
        assert rendering(record, waiting) is False
    # ComfyUI's history can say so before gpulane's records are on disk.
    rows = gw.wait_for(
        "SELECT id, status FROM requests WHERE id IN (?, ?, ?) AND finished_at IS NOT NULL",
        running,
        waiting,
        given,
        count=3,
    )
    assert {r["status"] for r in rows} == {"cancelled"}
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_user_key_sees_and_cancels_only_its_own_prompts(gateway: Start, tmp_path: Path) -> None:
    keys = textwrap.dedent(
        """
        apiKeys:
          - {key: sk-admin-0000000000, label: admin, role: admin}
          - {key: sk-alice-0000000000, label: alice, role: user}
          - {key: sk-bob-00000000000, label: bob, role: user}
        """
    )
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record, keys=keys))

    def as_(key: str) -> httpx.Client:
        return gw.client(headers={"Authorization": f"Bearer {key}"})

    with as_("sk-alice-0000000000") as alice, as_("sk-bob-00000000000") as bob:
        mine = alice.post("/comfyui/prompt", json={"prompt": workflow(1.0)}).json()["prompt_id"]
        theirs = bob.post("/comfyui/prompt", json={"prompt": workflow(20)}).json()["prompt_id"]
        entry = history(alice, mine)[mine]
        assert entry["status"]["completed"] is True
        assert bob.get(f"/comfyui/history/{mine}").json() == {}
        assert mine not in bob.get("/comfyui/history").json()
        assert mine in alice.get("/comfyui/history").json()
        assert wait_for(lambda: rendering(record, theirs))
        assert alice.get("/comfyui/queue").json()["queue_running"] == []
        alice.post("/comfyui/interrupt", json={"prompt_id": theirs})
        alice.post("/comfyui/interrupt", json={})
        assert [i[1] for i in bob.get("/comfyui/queue").json()["queue_running"]] == [theirs]
        image = entry["outputs"]["2"]["images"][0]["filename"]
        assert bob.get(f"/comfyui/view?filename={image}").status_code == 403
        assert bob.delete(f"/api/requests/{theirs}").status_code == 200


def test_a_render_refused_by_comfyui_fails_with_its_history_saying_why(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    with gw.client() as client:
        bad = {"1": {"class_type": "NoSuchNode", "inputs": {}}}
        prompt_id = client.post("/comfyui/prompt", json={"prompt": bad}).json()["prompt_id"]
        entry = history(client, prompt_id)[prompt_id]
        assert entry["status"]["status_str"] == "error"
        assert "NoSuchNode does not exist" in json.dumps(entry)
        assert client.post("/comfyui/prompt", json={}).status_code == 400  # ComfyUI's no_prompt
    # ComfyUI's history can say so before gpulane's record of it is on disk.
    (row,) = gw.wait_for(
        "SELECT status, error FROM requests WHERE id=? AND finished_at IS NOT NULL", prompt_id
    )
    assert row["status"] == "failed" and "NoSuchNode" in row["error"]


def test_a_crash_mid_render_ends_the_render_exactly_once(gateway: Start, tmp_path: Path) -> None:
    """gpulane SIGKILLed mid-render: the next start puts the prompt back as a
    retry (its ComfyUI was stopped with it), renders it again, and it ends once."""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    # The render's last step waits until gpulane is killed (a fixed render could
    # end first on a slow host); sent again, it runs to its end.
    release = tmp_path / "release"
    with gw.client() as client:
        body = {"prompt": workflow(2.0, hold_file=str(release))}
        prompt_id = client.post("/comfyui/prompt", json=body).json()["prompt_id"]
        assert wait_for(lambda: rendering(record, prompt_id))
    gw.kill()
    release.touch()
    gw.start()
    with gw.client() as client:
        entry = history(client, prompt_id, timeout=60)[prompt_id]
        assert entry["status"]["completed"] is True
    terminal = gw.wait_for(  # ComfyUI's history can come before the event is on disk
        "SELECT type FROM events WHERE request_id=? AND type IN "
        "('request_completed', 'request_failed', 'request_cancelled', 'request_abandoned')",
        prompt_id,
    )
    assert [r["type"] for r in terminal] == ["request_completed"]
    (row,) = gw.sql("SELECT attempt FROM requests WHERE id=?", prompt_id)
    assert row["attempt"] == 2
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_chain_of_twenty_prompts_shows_its_progress_and_an_estimate(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    headers = {
        "X-Gpulane-Chain": "reel-1",
        "X-Gpulane-Chain-Length": "20",
        "X-Gpulane-Caller": "studio",
        "X-LlamaSwap-Priority": "batch",
    }
    with gw.client() as client:
        ids = [
            client.post("/comfyui/prompt", json={"prompt": workflow(0.3)}, headers=headers).json()[
                "prompt_id"
            ]
            for _ in range(20)
        ]
        seen = wait_for(
            lambda: (
                (c := client.get("/api/chains/reel-1?caller=studio").json())["progress"]["done"]
                >= 3
                and c
            )
        )
        progress = seen["progress"]
        assert (progress["total"], progress["running"]) == (20, 1), progress
        assert progress["estimated_finish_in_s"] > 0
        # Each render's run is learnt from its real length, not its submission's.
        assert progress["basis"]["run_s"]["comfyui_auto"] >= 0.25, progress["basis"]
        assert history(client, ids[-1], timeout=60)[ids[-1]]["status"]["completed"] is True
    assert overlaps(record) == []


def test_an_operator_unload_mid_render_puts_it_back_and_it_renders_again(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    with gw.client() as client:
        prompt_id = queued(client, 2.0)
        assert wait_for(lambda: rendering(record, prompt_id))
        assert client.post("/api/models/unload/comfyui_auto").status_code == 200
        entry = history(client, prompt_id, timeout=60)[prompt_id]
        assert entry["status"]["completed"] is True
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    starts = [r for r in records(record) if r["event"] == "render_started"]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]  # a fresh ComfyUI
    kinds = [
        r["type"]
        for r in gw.sql("SELECT type FROM events WHERE request_id=? ORDER BY seq", prompt_id)
    ]
    assert kinds.count("request_requeued") == 1 and kinds.count("request_completed") == 1
    assert "request_failed" not in kinds and "request_cancelled" not in kinds
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_renders_progress_drives_its_expected_end_in_the_queue(
    gateway: Start, tmp_path: Path
) -> None:
    """An 8 s render of 40 steps, past every run of its model (one of 0.1 s: its
    end is open until it reports progress). ComfyUI's websocket says how far
    it is; gpulane listens with its own client id and records it, sampled: once
    it is half done, `/api/queue` expects it to end about 8 s after its
    dispatch, and the progress it shows only grows."""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    with gw.client() as client:
        # ComfyUI loaded first: a load the render waited for counts in its run
        # (twice, at half done), and a slow host's load would pass the bound.
        warm = queued(client, 0.1)
        assert history(client, warm)[warm]["status"]["completed"] is True
        r = client.post("/comfyui/prompt", json={"prompt": workflow(8.0, steps=40)})
        assert r.status_code == 200, r.text
        prompt_id = r.json()["prompt_id"]

        half, seen = half_done(client, prompt_id)
        assert not half["expected_end_open"], half
        expected_s = half["expected_end_at"] - half["since"]
        assert 6.0 <= expected_s <= 14.0, f"expected {expected_s:.1f} s in all for an 8 s render"
        assert seen == sorted(seen) and seen[-1][1] == 40, seen
        assert history(client, prompt_id)[prompt_id]["status"]["completed"] is True
    progressed = progress_events(gw, prompt_id)
    # Sampled: a record per tenth at most (a check a second), not one per step.
    assert 2 <= len(progressed) <= 11, progressed
    assert all(p["total"] == 40 for p in progressed)
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    assert_log_replays(gw.db)


def test_comfyuis_own_websocket_is_a_side_channel_that_never_holds_the_render_slot(
    gateway: Start, tmp_path: Path
) -> None:
    """ComfyUI's own socket, for an admin at `/upstream/MODEL/ws`, is no job.
    Like ComfyUI's other side paths it loads nothing (409 while ComfyUI does not
    run), and while it is open a prompt renders at once; it takes no slot and
    records no request. (A client's socket is gpulane's own, `/comfyui/ws`:
    tests/e2e/test_comfyui_sockets.py.)"""
    record = tmp_path / "renders.jsonl"
    gw = gateway(comfy_config(record))
    url = gw.url.replace("http", "ws", 1) + "/upstream/comfyui_auto/ws?clientId=watcher"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10).close()
    assert refused.value.response.status_code == 409
    error = json.loads(refused.value.response.body or b"")["error"]
    assert error["code"] == "model_not_loaded" and "/comfyui/prompt" in error["message"], error
    with gw.client() as client:
        assert client.get("/running").json()["running"] == []
        first = queued(client, 0.2)
        assert history(client, first)[first]["status"]["completed"] is True
        with connect(url, open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "status"
            second = client.post("/comfyui/prompt", json={"prompt": workflow(0.5)}).json()
            # Renders while the socket stays open (it used to wait for its close).
            assert history(client, second["prompt_id"], timeout=20)
            # ComfyUI's own messages reach it (its queue's status: the prompt put,
            # then done); the prompt's go to gpulane's probe, whose id it was sent with.
            queue = []
            while queue[-2:] != [1, 0]:
                message = json.loads(ws.recv(timeout=10))
                assert message["type"] == "status", message
                queue.append(message["data"]["status"]["exec_info"]["queue_remaining"])
            # ComfyUI's history can say so before gpulane has seen the render end.
            poll(
                lambda: sum(r["in_flight"] for r in client.get("/running").json()["running"]) == 0,
                "the render's slot freed with the socket still open",
            )
    (sockets,) = gw.sql("SELECT count(*) AS n FROM requests WHERE endpoint LIKE '%/ws'")
    assert sockets["n"] == 0
