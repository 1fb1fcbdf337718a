"""The OpenAI Files and Batch APIs on durable jobs (issue 25), through `gpulane
serve` as a user starts it, driven with the official `openai` client."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.gateway import Gateway, fake_model, poll

Start = Callable[[str], Gateway]
ALICE, BOB = "sk-alice-71c3", "sk-bob-2e98"


def config(extra: str = "") -> str:
    models = "".join(fake_model(m) for m in ("A", "B")).replace("\n", "\n  ")
    return f"{extra}models:{models}\n"


def client(gw: Gateway, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def line(custom_id: str, model: str = "A", **fake: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": custom_id}], "fake": fake}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def submit(oa: openai.OpenAI, lines: list[dict[str, Any]], **kw: Any) -> Any:
    uploaded = oa.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return oa.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window=kw.pop("completion_window", "24h"),
        **kw,
    )


def wait_batch(oa: openai.OpenAI, batch_id: str, *want: str, timeout: float = 30) -> Any:
    return poll(
        lambda: (b := oa.batches.retrieve(batch_id)).status in want and b,
        f"batch {batch_id} to be {' or '.join(want)}",
        timeout=timeout,
    )


def answers(oa: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in oa.files.content(file_id).text.splitlines() if x]


def test_a_batch_runs_each_line_as_a_durable_job_and_answers_every_custom_id(
    gateway: Start,
) -> None:
    gw = gateway(config())
    oa = client(gw)
    lines = [line(f"shot-{i:03}", "A" if i % 2 else "B", reply=f"frame {i}") for i in range(6)]
    lines.append(line("lost", "no-such-model"))
    lines.append(line("upstream-error", "A", status=500))
    uploaded = oa.files.create(file=("film.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert oa.files.retrieve(uploaded.id).filename == "film.jsonl"
    assert uploaded.id in [f.id for f in oa.files.list()]
    assert oa.files.content(uploaded.id).content == jsonl(lines)

    batch = oa.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"film": "dawn"},
    )
    assert batch.status in ("in_progress", "finalizing", "completed")
    assert batch.metadata == {"film": "dawn"}
    done = wait_batch(oa, batch.id, "completed")
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (8, 6)
    assert done.request_counts.failed == 2
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    out = answers(oa, done.output_file_id)
    errors = answers(oa, done.error_file_id)
    ids = sorted(a["custom_id"] for a in out + errors)
    assert ids == sorted(x["custom_id"] for x in lines)  # each exactly once
    for a in out:
        assert a["response"]["status_code"] == 200 and a["error"] is None
        n = int(a["custom_id"].split("-")[1])
        assert a["response"]["body"]["choices"][0]["message"]["content"] == f"frame {n}"
    by_id = {a["custom_id"]: a for a in errors}
    assert by_id["lost"]["error"]["code"] == "model_not_found"
    assert "no-such-model" in by_id["lost"]["error"]["message"]
    assert by_id["upstream-error"]["response"]["status_code"] == 500
    assert done.id in [b.id for b in oa.batches.list()]

    # One mechanism: the lines are durable jobs in the batch band.
    with gw.client() as http:
        jobs = http.get("/v1/jobs?limit=100").json()["data"]
    assert len(jobs) == 7 and {j["band"] for j in jobs} == {"batch"}
    assert {j["status"] for j in jobs} == {"completed"}
    rows = gw.sql("SELECT job FROM requests WHERE durable")
    assert {json.loads(r["job"])["batch_id"] for r in rows} == {batch.id}

    assert oa.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        oa.files.retrieve(uploaded.id)


def test_a_malformed_file_fails_the_batch_naming_each_bad_line(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    good = json.dumps(line("ok"))
    text = "\n".join(
        [
            good,
            "{not json",
            json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {"model": "A"}}),
            good,
            json.dumps(line("x") | {"url": "/v1/embeddings"}),
        ]
    )
    uploaded = oa.files.create(file=("bad.jsonl", text.encode()), purpose="batch")
    batch = oa.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data is not None
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (4, "duplicate_custom_id"),
        (5, "mismatched_endpoint"),
    }
    assert all(f"line {e.line}" in (e.message or "") for e in batch.errors.data)
    assert gw.sql("SELECT count(*) AS n FROM requests")[0]["n"] == 0


def test_an_upload_over_the_limit_is_413_naming_the_key(gateway: Start) -> None:
    gw = gateway(config("jobs:\n  maxFileBytes: 1000\n"))
    oa = client(gw)
    with pytest.raises(openai.APIStatusError) as caught:
        oa.files.create(file=("big.jsonl", b"x" * 2000), purpose="batch")
    assert caught.value.status_code == 413
    assert "jobs.maxFileBytes" in caught.value.message
    assert oa.files.create(file=("small.jsonl", b"x" * 900), purpose="batch").bytes == 900


def test_cancel_withdraws_the_waiting_lines_and_lets_the_running_one_finish(
    gateway: Start,
) -> None:
    gw = gateway(config())
    oa = client(gw)
    # The first line runs until the cancel was answered: a fixed run could end
    # first on a slow host, and the next line start.
    release = gw.tmp / "release"
    lines = [line("first", hold_file=str(release), reply="kept")]
    batch = submit(oa, lines + [line(f"w{i}") for i in range(4)])
    try:
        with gw.client() as http:
            poll(
                lambda: any(j["status"] == "running" for j in http.get("/v1/jobs").json()["data"]),
                "the first line to run",
            )
        cancelling = oa.batches.cancel(batch.id)
    finally:
        release.touch()
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_batch(oa, batch.id, "cancelled")
    assert done.cancelled_at
    [kept] = answers(oa, done.output_file_id)
    assert kept["custom_id"] == "first"
    assert kept["response"]["body"]["choices"][0]["message"]["content"] == "kept"
    errors = answers(oa, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == [f"w{i}" for i in range(4)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        oa.batches.cancel(batch.id)


def test_lines_not_started_within_the_completion_window_expire(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    # A is loaded first and the window is 5 s, so the first line starts within it
    # on a loaded host too; it is held until the others have expired behind it
    # (a fixed 3 s run against a 1 s window raced the load and the start).
    with gw.client() as http:
        warm = http.post("/v1/chat/completions", json=line("warm")["body"])
        assert warm.status_code == 200, warm.text
    release = gw.tmp / "release"
    lines = [line("slow", hold_file=str(release))] + [line(f"late{i}") for i in range(3)]
    batch = submit(oa, lines, completion_window="5s")
    try:
        gw.wait_for(
            "SELECT 1 FROM events WHERE type = 'request_cancelled' "
            "AND json_extract(data, '$.reason') = 'deadline'",
            count=3,
        )
    finally:
        release.touch()
    done = wait_batch(oa, batch.id, "expired")
    assert done.expired_at
    [slow] = answers(oa, done.output_file_id)
    assert slow["custom_id"] == "slow"
    errors = answers(oa, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["late0", "late1", "late2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_a_batchs_lines_are_outside_the_callers_queue_bound_also_after_a_restart(
    gateway: Start,
) -> None:
    """maxQueuedPerCaller bounds a caller's single requests: a batch bigger than
    it is accepted whole, and its waiting lines leave the caller's room for
    single requests as it was (docs/jobs.md, The Batch API)."""
    gw = gateway(config("maxQueuedPerCaller: 2\n"))
    oa = client(gw)
    with gw.client() as http:

        def single(**fake: Any) -> httpx.Response:
            body = line("single", **fake)["body"]
            return http.post("/v1/chat/completions", json=body, headers={"Prefer": "respond-async"})

        blocker = single(hang=True).json()["id"]
        poll(lambda: http.get(f"/v1/jobs/{blocker}").json()["status"] == "running", "a blocker")
        batch = submit(oa, [line(f"l{i}") for i in range(5)])
        assert batch.status == "in_progress" and batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.failed) == (5, 0)
        first, second = single(), single()
        assert (first.status_code, second.status_code) == (202, 202), first.text + second.text
        third = single()
        assert third.status_code == 429, third.text
        assert third.json()["error"]["code"] == "caller_queue_full"
        assert "has 2 requests waiting" in third.json()["error"]["message"]

        gw.kill()
        gw.start()  # recovery puts the lines back, still outside the bound
        assert single().status_code == 429
        assert http.delete(f"/v1/jobs/{first.json()['id']}").status_code == 200
        fourth = single()
        assert fourth.status_code == 202, fourth.text
        progress = oa.batches.retrieve(batch.id).model_extra["gpulane_progress"]
        assert progress["waiting"] == 5
        # The blocker hangs again after the restart: cut it off, so the lane ends.
        assert http.delete(f"/v1/jobs/{blocker}").status_code == 200
    wait_batch(oa, batch.id, "completed")


def test_a_batch_survives_sigkill_and_answers_every_custom_id_once(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    lines = [line(f"shot-{i:02}", delay=0.3, reply=f"frame {i}") for i in range(8)]
    batch = submit(oa, lines)
    gw.wait_for("SELECT 1 FROM requests WHERE status = 'completed'", count=2, timeout=20)
    gw.kill()
    gw.start()
    done = wait_batch(oa, batch.id, "completed", timeout=60)
    out = answers(oa, done.output_file_id)
    assert sorted(a["custom_id"] for a in out) == [x["custom_id"] for x in lines]
    assert done.error_file_id is None
    for a in out:
        n = int(a["custom_id"].split("-")[1])
        assert a["response"]["body"]["choices"][0]["message"]["content"] == f"frame {n}"
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_user_key_cannot_see_another_callers_file_or_batch(gateway: Start) -> None:
    keys = f"apiKeys:\n  - key: {ALICE}\n    label: alice\n  - key: {BOB}\n    label: bob\n"
    gw = gateway(config(keys))
    alice, bob = client(gw, ALICE), client(gw, BOB)
    batch = submit(alice, [line("mine")])
    assert batch.input_file_id
    done = wait_batch(alice, batch.id, "completed")
    assert done.output_file_id
    for file_id in (batch.input_file_id, done.output_file_id):
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            bob.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    # Nor can bob run a batch on alice's file.
    with pytest.raises(openai.NotFoundError) as on_alices:
        bob.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    # In OpenAI's shape, the error names the field at fault.
    assert (on_alices.value.code, on_alices.value.param) == ("file_not_found", "input_file_id")
    assert [b.id for b in bob.batches.list()] == []
    assert [f.id for f in bob.files.list()] == []
    assert batch.id in [b.id for b in alice.batches.list()]
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"
    with httpx.Client(base_url=gw.url) as http:
        owner = http.get(f"/v1/batches/{batch.id}", headers={"Authorization": f"Bearer {ALICE}"})
    assert owner.json()["caller"] == "alice"


def test_a_batch_queues_at_batch_priority_unless_it_asks_within_its_keys_cap(
    gateway: Start,
) -> None:
    keys = (
        f"apiKeys:\n  - key: {ALICE}\n    label: alice\n    defaultPriority: normal+2\n"
        f"  - key: {BOB}\n    label: bob\n    maxPriority: normal\n"
    )
    gw = gateway(config(keys))
    alice, bob = client(gw, ALICE), client(gw, BOB)
    plain = submit(alice, [line("a")])
    asked = submit(bob, [line("b")], metadata={"priority": "interactive"})
    header = submit(bob, [line("c")], extra_headers={"X-LlamaSwap-Priority": "-101"}, metadata={})
    for batch in (plain, asked, header):
        wait_batch(alice if batch is plain else bob, batch.id, "completed")
    rows = gw.sql("SELECT caller, priority, band, job FROM requests ORDER BY enqueue_seq")
    got = [(r["caller"], r["priority"], json.loads(r["job"])["custom_id"]) for r in rows]
    assert got == [("alice", -98, "a"), ("bob", 0, "b"), ("bob", -101, "c")]
    with pytest.raises(openai.BadRequestError):
        submit(bob, [line("d")], metadata={"priority": "urgent"})


def test_a_batch_left_validating_by_a_crash_queues_its_lines_at_the_next_start(
    gateway: Start,
) -> None:
    """The batch, its lines and their bodies were committed, and the server died
    before any line's enqueue reached the disk: the next start queues them."""
    gw = gateway(config())
    gw.stop()
    conn = sqlite3.connect(gw.db)
    with conn:
        now = time.time()
        conn.execute(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, priority,"
            " status, total, created_at, expires_at) VALUES"
            " ('batch_x', '/v1/chat/completions', 'file-x', '24h', -100, 'validating', 3, ?, ?)",
            (now, now + 86400),
        )
        for n in range(3):
            body = json.dumps(line(f"c{n}", reply=f"r{n}")["body"]).encode()
            conn.execute(
                "INSERT INTO batch_lines (batch_id, line, custom_id, model, request_id)"
                " VALUES ('batch_x', ?, ?, 'A', ?)",
                (n + 1, f"c{n}", f"rid{n}"),
            )
            # Stored before this process started: pruning must leave it for the batch.
            conn.execute(
                "INSERT INTO job_bodies (request_id, stored_at, body) VALUES (?, ?, ?)",
                (f"rid{n}", now - 60, body),
            )
    conn.close()
    gw.start()
    oa = client(gw)
    done = wait_batch(oa, "batch_x", "completed")
    out = answers(oa, done.output_file_id)
    got = sorted(
        (a["custom_id"], a["response"]["body"]["choices"][0]["message"]["content"]) for a in out
    )
    assert got == [("c0", "r0"), ("c1", "r1"), ("c2", "r2")]


def test_two_callers_batches_share_the_gpu_under_fair_share(gateway: Start) -> None:
    """Alice's batch is all queued before Bob's: in arrival order she would have
    the GPU until her last line ends. With fair share on, Bob's lines are served
    between hers as soon as she has had more GPU time than he has."""
    keys = f"apiKeys:\n  - key: {ALICE}\n    label: alice\n  - key: {BOB}\n    label: bob\n"
    fair = "routing:\n  scheduler:\n    settings:\n      serial:\n        fairShareBonus: 20\n"
    gw = gateway(config(keys + fair))
    alice, bob = client(gw, ALICE), client(gw, BOB)
    # Alice's first run lasts until Bob's batch is queued too: on a slow host
    # her short runs could otherwise be over before his arrive.
    release = gw.tmp / "release"
    first = submit(alice, [line(f"a{i}", delay=0.3, hold_file=str(release)) for i in range(6)])
    try:
        second = submit(bob, [line(f"b{i}", delay=0.3) for i in range(6)])
        poll(
            lambda: len(gw.sql("SELECT 1 FROM requests WHERE status = 'queued'")) == 11,
            "both batches queued behind Alice's first run",
        )
    finally:
        release.touch()
    for oa, batch in ((alice, first), (bob, second)):
        done = wait_batch(oa, batch.id, "completed", timeout=60)
        assert done.request_counts is not None and done.request_counts.completed == 6
    order = [
        r["caller"]
        for r in gw.sql(
            "SELECT r.caller FROM events e JOIN requests r ON r.id = e.request_id "
            "WHERE e.type = 'request_dispatched' ORDER BY e.seq"
        )
    ]
    assert sorted(order) == ["alice"] * 6 + ["bob"] * 6
    # Bob does not wait for Alice's whole batch: he has half of the first eight runs.
    assert order[:8].count("bob") >= 3, order
    assert order.index("bob") < order.index("alice") + 3, order
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
