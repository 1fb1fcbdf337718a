"""OpenAI's Videos API through gpulane: each video holds its model until it ends (issue 41).

The real server in front of tools/fake_video_server.py (a real process that
renders in a worker thread, as an asynchronous Videos API server does) and
tools/fake_upstream.py for chats; the official `openai` client's `videos`
resource where a client would use it. The fake appends a line per render start
and end, and one when SIGTERM arrives mid-render, so each test reads what the
server really went through.
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
import openai
import pytest

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
FAKE = f"{sys.executable} -m tools.fake_video_server"
# The client marks the Videos API deprecated (OpenAI's Sora API ends in 2026): not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
KEYS = textwrap.dedent(
    """
    apiKeys:
      - {key: sk-admin-0000000000, label: admin, role: admin}
      - {key: sk-alice-0000000000, label: alice, role: user}
      - {key: sk-bob-00000000000, label: bob, role: user}
    """
)


def video_config(record: Path, *, args: str = "", keys: str = "", extra: str = "") -> str:
    """A Videos API server (`kind: openai-videos`) beside a chat model, one at a
    time on one GPU."""
    server = textwrap.dedent(
        f"""
          sora-local:
            kind: openai-videos
            cmd: {FAKE} --port ${{PORT}} --record {record} {args}
            checkEndpoint: /health
            concurrencyLimit: 8
            maxRunTime: 120
        """
    )
    entries = (server + fake_model("chat") + extra).replace("\n", "\n  ")
    return keys + "models:" + entries + "\n"


def rendering(record: Path) -> list[str]:
    return [r["video_id"] for r in records(record) if r["event"] == "render_started"]


def ends(record: Path) -> list[dict[str, Any]]:
    return [r for r in records(record) if r["event"] == "render_ended"]


def sdk(gw: Gateway, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def chat() -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def settled(client: httpx.Client, video_id: str, timeout: float = 30) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: (
            (v := client.get(f"/v1/videos/{video_id}").json())["status"] in ("completed", "failed")
            and v
        ),
        timeout=timeout,
    )
    return found


def test_the_openai_client_creates_polls_and_downloads_a_video_held_until_its_end(
    gateway: Start, tmp_path: Path
) -> None:
    """Issue 41's done-when: a 3 s video through the official client; a chat for
    another model 1 s into it waits for the video's end (its server is never
    stopped mid-render); the content is served after the server was swapped out;
    explain says why the chat waited."""
    record = tmp_path / "videos.jsonl"
    # The render's last step waits for the test: a fixed render could end before
    # the chat arrives on a slow host.
    release = tmp_path / "release"
    gw = gateway(video_config(record, args=f"--render-s 3 --hold-file {release}"))
    client = sdk(gw)
    video = client.videos.create(model="sora-local", prompt="a lane of GPUs", seconds="4")
    # At once, not at the render's end (which waits for the test: no clock needed).
    assert not ends(record), "the create was answered once its video was rendered"
    assert (video.object, video.status, video.progress, video.prompt) == (
        "video",
        "queued",
        0,
        "a lane of GPUs",
    )
    with gw.client() as http, cf.ThreadPoolExecutor(1) as pool:
        assert wait_for(lambda: rendering(record) != []), "the render never started"
        seen = wait_for(lambda: (v := client.videos.retrieve(video.id)).progress > 0 and v)
        assert seen.status == "in_progress" and 0 < seen.progress < 100, seen
        pending = pool.submit(http.post, "/v1/chat/completions", json=chat())
        try:
            # Released once the chat has waited over a second behind it.
            poll(
                lambda: [
                    w for w in http.get("/api/queue").json()["waiting"] if w["waited_s"] > 1.2
                ],
                "the chat to wait behind the video",
            )
        finally:
            release.touch()
        answer = pending.result(timeout=60)
        assert answer.status_code == 200, answer.text
        chat_done = time.time()
        ended = ends(record)
        assert [e["outcome"] for e in ended] == ["completed"]
        assert ended[0]["at"] <= chat_done, "the chat was answered before the video ended"
        assert not [r for r in records(record) if r["event"] == "stopped_mid_render"]
        done = client.videos.poll(video.id, poll_interval_ms=100)
        assert (done.status, done.progress, done.error) == ("completed", 100, None)
        assert done.completed_at is not None and done.expires_at is not None
        # The chat swapped the video server out: the content comes from gpulane.
        assert wait_for(lambda: http.get("/running").json()["running"][0]["model"] == "chat")
        content = client.videos.download_content(video.id).read()
        assert content.startswith(b"\x00\x00\x00\x18ftypmp42")
        thumb = http.get(f"/v1/videos/{video.id}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/webp"
        bad = http.get(f"/v1/videos/{video.id}/content", params={"variant": "gif"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "variant"
        explained = http.get(f"/api/requests/{answer.headers['x-request-id']}/explain").json()
        (behind,) = explained["running_at_arrival"]
        assert (behind["request_id"], behind["model"], behind["render"]) == (
            video.id,
            "sora-local",
            True,
        )
        assert behind["held_s"] > 1.0, behind
        listed = client.videos.list()
        assert [v.id for v in listed.data] == [video.id]
    gw.wait_for(  # the answer can come before its event is on disk
        "SELECT 1 FROM events WHERE request_id=? AND type='request_completed'", video.id
    )
    events = [row["type"] for row in gw.sql("SELECT type FROM events WHERE request_id=?", video.id)]
    assert events.count("request_completed") == 1 and "request_failed" not in events
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    assert_log_replays(gw.db)


def test_a_waiting_video_shows_its_place_and_estimate_and_a_failed_one_its_error(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "videos.jsonl"
    gw = gateway(video_config(record, args="--render-s 1.5"))
    with gw.client() as http:
        first = http.post("/v1/videos", json={"prompt": "one", "model": "sora-local"}).json()
        second = http.post("/v1/videos", json={"prompt": "fail: two"}).json()  # the only model
        assert wait_for(lambda: rendering(record) != [])
        waiting = http.get(f"/v1/videos/{second['id']}").json()
        assert waiting["status"] == "queued", waiting
        assert waiting["gpulane"]["place"] == 1 and waiting["gpulane"]["expected_start"] > 0
        # The priority header moves a video ahead in gpulane's queue; a chain names it.
        urgent = http.post(
            "/v1/videos",
            json={"prompt": "three"},
            headers={"X-LlamaSwap-Priority": "interactive", "X-Gpulane-Chain": "film"},
        ).json()
        failed = settled(http, second["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "video_generation_failed", failed
        assert "told to fail" in failed["error"]["message"]
        assert settled(http, first["id"])["status"] == "completed"
        r = http.get(f"/v1/videos/{second['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
        assert settled(http, urgent["id"])["status"] == "completed"
        order = [r["prompt"] for r in records(record) if r["event"] == "render_started"]
        assert order == ["one", "three", "fail: two"]
        # Renders never overlapped, whatever concurrencyLimit says.
        starts = [r["event"] for r in records(record) if r["event"].startswith("render_")]
        assert starts == ["render_started", "render_ended"] * 3
        # Pagination as the spec has it.
        page = http.get("/v1/videos", params={"limit": 2}).json()
        assert page["has_more"] is True
        assert [v["id"] for v in page["data"]] == [urgent["id"], second["id"]]
        rest = http.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
        assert [v["id"] for v in rest["data"]] == [first["id"]] and rest["has_more"] is False
        oldest = http.get("/v1/videos", params={"order": "asc", "limit": 1}).json()
        assert oldest["data"][0]["id"] == first["id"]
        assert http.post("/v1/videos", json={"model": "chat", "prompt": "x"}).status_code == 400
        assert http.post("/v1/videos", json={"model": "sora-local"}).status_code == 400
    (enqueued,) = gw.sql(
        "SELECT data FROM events WHERE request_id=? AND type='request_enqueued'", urgent["id"]
    )
    doc = json.loads(enqueued["data"])
    assert (doc["priority"], doc["chain"]) == (100, "film")


def test_a_videos_progress_drives_its_expected_end_in_the_queue(
    gateway: Start, tmp_path: Path
) -> None:
    """An 8 s video, past every run of its model (a load's health check: its
    end is open until it reports progress). The server's `progress` (0-100) is
    recorded, sampled: once it is half done, `/api/queue` expects it to end
    about 8 s after its dispatch, and the progress it shows only grows."""
    record = tmp_path / "videos.jsonl"
    gw = gateway(video_config(record, args="--render-s 8"))
    with gw.client() as http:
        # The server loaded first, as the console's Load does: a load the video
        # waited for counts in its run (twice, at half done), and a slow host's
        # load would pass the bound.
        assert http.get("/upstream/sora-local/health").status_code == 200
        video_id = http.post("/v1/videos", json={"prompt": "slow"}).json()["id"]
        half, seen = half_done(http, video_id)
        assert not half["expected_end_open"], half
        expected_s = half["expected_end_at"] - half["since"]
        assert 6.0 <= expected_s <= 14.0, f"expected {expected_s:.1f} s in all for an 8 s video"
        assert seen == sorted(seen) and all(total == 100 for _, total in seen), seen
        assert settled(http, video_id)["status"] == "completed"
    progressed = progress_events(gw, video_id)
    assert 2 <= len(progressed) <= 11, progressed
    assert all(p["total"] == 100 for p in progressed)
    assert_log_replays(gw.db)


def test_remix_and_delete_and_a_server_without_remix(gateway: Start, tmp_path: Path) -> None:
    record = tmp_path / "videos.jsonl"
    plain_record = tmp_path / "plain.jsonl"
    plain_args = "--no-remix --no-variants --sync"
    other = textwrap.dedent(
        f"""
        plain-videos:
          kind: openai-videos
          cmd: {FAKE} --port ${{PORT}} --render-s 0.3 {plain_args} --record {plain_record}
          checkEndpoint: /health
        """
    )
    gw = gateway(video_config(record, args="--render-s 0.5", extra=other))
    client = sdk(gw)
    with gw.client() as http:
        source = client.videos.create(model="sora-local", prompt="a cat")
        assert client.videos.poll(source.id, poll_interval_ms=100).status == "completed"
        remix = client.videos.remix(source.id, prompt="a cat, in the rain")
        assert remix.remixed_from_video_id == source.id
        assert client.videos.poll(remix.id, poll_interval_ms=100).status == "completed"
        # A server without remix (and answering synchronously): the remix fails, saying so.
        # The client's upload (multipart, `input_reference`) reaches it as sent.
        reference = ("ref.png", b"\x89PNG\r\n" + bytes(5000), "image/png")
        plain = client.videos.create(
            model="plain-videos", prompt="a dog", input_reference=reference
        )
        assert client.videos.poll(plain.id, poll_interval_ms=100).status == "completed"
        (started,) = [r for r in records(plain_record) if r["event"] == "render_started"]
        assert started["reference_bytes"] == 5006
        r = http.get(f"/v1/videos/{plain.id}/content", params={"variant": "thumbnail"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "variant_not_available"
        failed = client.videos.poll(
            client.videos.remix(plain.id, prompt="x").id, poll_interval_ms=100
        )
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "remix_not_supported", failed.error
        deleted = client.videos.delete(source.id)
        assert (deleted.id, deleted.deleted) == (source.id, True)
        assert http.get(f"/v1/videos/{source.id}").status_code == 404
        assert http.get(f"/v1/videos/{source.id}/content").status_code == 404
        assert source.id not in [v.id for v in client.videos.list().data]


def test_a_user_key_sees_fetches_and_deletes_only_its_own_videos(
    gateway: Start, tmp_path: Path
) -> None:
    record = tmp_path / "videos.jsonl"
    gw = gateway(video_config(record, args="--render-s 0.5", keys=KEYS))
    alice, bob = sdk(gw, "sk-alice-0000000000"), sdk(gw, "sk-bob-00000000000")
    mine = alice.videos.create(model="sora-local", prompt="alice's")
    assert alice.videos.poll(mine.id, poll_interval_ms=100).status == "completed"
    for call in (
        lambda: bob.videos.retrieve(mine.id),
        lambda: bob.videos.download_content(mine.id),
        lambda: bob.videos.delete(mine.id),
    ):
        try:
            call()
        except openai.NotFoundError:
            continue
        raise AssertionError("bob reached alice's video")
    assert bob.videos.list().data == []
    assert [v.id for v in alice.videos.list().data] == [mine.id]
    assert alice.videos.download_content(mine.id).read().startswith(b"\x00\x00\x00\x18ftyp")
    # Without a key, nothing: the collection's own path too (a mount's path
    # reaches the key middleware as `/`, which the console leaves open).
    with gw.client() as anonymous:
        for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos")):
            r = anonymous.request(method, path, json={"prompt": "x"})
            assert r.status_code == 401, (method, path, r.text)
        assert anonymous.get(f"/v1/videos/{mine.id}").status_code == 401


def test_a_crash_mid_video_ends_it_exactly_once(gateway: Start, tmp_path: Path) -> None:
    """gpulane SIGKILLed mid-render: the next start puts the video back as a retry
    (its server was stopped with it), renders it again, and it ends once."""
    record = tmp_path / "videos.jsonl"
    # The render's last step waits until gpulane is killed (a fixed render could
    # end first on a slow host); the next one runs to its end.
    release = tmp_path / "release"
    gw = gateway(video_config(record, args=f"--render-s 2 --hold-file {release}"))
    with gw.client() as http:
        video_id = http.post("/v1/videos", json={"prompt": "p", "model": "sora-local"}).json()["id"]
        assert wait_for(lambda: rendering(record) != [])
    gw.kill()
    release.touch()
    gw.start()
    with gw.client() as http:
        done = settled(http, video_id, timeout=60)
        assert done["status"] == "completed", done
        assert http.get(f"/v1/videos/{video_id}/content").status_code == 200
    terminal = gw.wait_for(  # the answer can come before its event is on disk
        "SELECT type FROM events WHERE request_id=? AND type IN "
        "('request_completed', 'request_failed', 'request_cancelled', 'request_abandoned')",
        video_id,
    )
    assert [r["type"] for r in terminal] == ["request_completed"]
    (row,) = gw.sql("SELECT attempt FROM requests WHERE id=?", video_id)
    assert row["attempt"] == 2
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_batch_of_videos_runs_each_line_as_a_held_video(gateway: Start, tmp_path: Path) -> None:
    """The Batch API takes `/v1/videos` (OpenAI's spec lists it): each line is a
    video held until its end, its answer the video with gpulane's id, whose
    content gpulane serves."""
    record = tmp_path / "videos.jsonl"
    gw = gateway(video_config(record, args="--render-s 0.4"))
    client = sdk(gw)
    lines = [
        {
            "custom_id": f"shot-{n}",
            "method": "POST",
            "url": "/v1/videos",
            "body": {"model": "sora-local", "prompt": f"shot {n}"},
        }
        for n in range(3)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("shots.jsonl", text), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/videos",  # type: ignore[arg-type]  # the spec has it; older clients' types do not
        completion_window="24h",
    )
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        timeout=60,
    )
    assert done and done.status == "completed", done
    assert done.output_file_id is not None
    output = client.files.content(done.output_file_id).read().decode()
    answers = {a["custom_id"]: a["response"] for a in map(json.loads, output.splitlines())}
    assert sorted(answers) == ["shot-0", "shot-1", "shot-2"]
    starts = [r["event"] for r in records(record) if r["event"].startswith("render_")]
    assert starts == ["render_started", "render_ended"] * 3  # one at a time, each held
    with gw.client() as http:
        for answer in answers.values():
            body = answer["body"]
            assert answer["status_code"] == 200 and body["status"] == "completed", answer
            video = http.get(f"/v1/videos/{body['id']}").json()
            assert video["status"] == "completed" and video["prompt"].startswith("shot ")
            assert http.get(f"/v1/videos/{body['id']}/content").status_code == 200


def test_an_operator_unload_mid_video_puts_it_back_and_it_renders_again_once(
    gateway: Start, tmp_path: Path
) -> None:
    """Only an operator's unload stops a video's server mid-render: the video goes
    back in the queue, is sent again, and ends once."""
    record = tmp_path / "videos.jsonl"
    # The render's last step waits until the unload is done (a fixed render could
    # end first on a slow host); the next one runs to its end.
    release = tmp_path / "release"
    gw = gateway(video_config(record, args=f"--render-s 3 --hold-file {release}"))
    with gw.client() as http:
        video_id = http.post("/v1/videos", json={"prompt": "p"}).json()["id"]
        assert wait_for(lambda: rendering(record) != [])
        try:
            assert http.post("/api/models/unload/sora-local").status_code == 200
        finally:
            release.touch()
        done = settled(http, video_id, timeout=60)
        assert done["status"] == "completed", done
    stopped = [r["video_id"] for r in records(record) if r["event"] == "stopped_mid_render"]
    first, second = rendering(record)
    assert stopped == [first]
    assert [(e["video_id"], e["outcome"]) for e in ends(record)] == [(second, "completed")]
    terminal = gw.wait_for(  # the answer can come before its event is on disk
        "SELECT type FROM events WHERE request_id=? AND type IN "
        "('request_completed', 'request_failed', 'request_cancelled', 'request_abandoned')",
        video_id,
    )
    assert [r["type"] for r in terminal] == ["request_completed"]


def test_content_over_the_disk_cap_is_not_kept_and_the_video_still_completes(
    gateway: Start, tmp_path: Path
) -> None:
    """jobs.maxVideoBytes: the fake's video (4 KiB) is over a 1,000-byte cap, its
    thumbnail is not. The video completes; its content is 410, saying why."""
    record = tmp_path / "videos.jsonl"
    gw = gateway(video_config(record, args="--render-s 0.3") + "jobs:\n  maxVideoBytes: 1000\n")
    with gw.client() as http:
        video_id = http.post("/v1/videos", json={"prompt": "big"}).json()["id"]
        assert settled(http, video_id)["status"] == "completed"
        r = http.get(f"/v1/videos/{video_id}/content")
        assert r.status_code == 410 and "jobs.maxVideoBytes" in r.json()["error"]["message"]
        thumb = http.get(f"/v1/videos/{video_id}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.content.startswith(b"RIFFthumbnail")
