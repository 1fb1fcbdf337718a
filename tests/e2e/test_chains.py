"""Chains (issue 29): requests a caller names as one run (`X-Gpulane-Chain`,
`X-Gpulane-Chain-Length`), synchronous or durable, with their progress in
`/api/chains/{id}`, `/api/queue`'s `runs`, `gpulane queue` and each shot's
explanation, through `gpulane serve` and the official `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.core import events as ev
from app.core.priority import ALIASES
from app.core.scoring import NS_PER_S
from tests.e2e.gateway import REPO, Gateway, fake_model, poll
from tests.unit.core_driver import T0, CoreDriver
from tools.replay.generate import write_log

Start = Callable[[str], Gateway]
ALICE, BOB, ADMIN = "sk-alice-5f1d", "sk-bob-0c77", "sk-admin-9e2a"
KEYS = (
    f"apiKeys:\n  - key: {ALICE}\n    label: alice\n  - key: {BOB}\n    label: bob\n"
    f"  - key: {ADMIN}\n    label: boss\n    role: admin\n"
)


def config(extra: str = "") -> str:
    return extra + "models:" + fake_model("video").replace("\n", "\n  ") + "\n"


def client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def shot(oa: openai.OpenAI, chain: str, length: int | None = None, **fake: Any) -> Any:
    headers = {"X-Gpulane-Chain": chain, "X-LlamaSwap-Priority": "batch"}
    if length is not None:
        headers["X-Gpulane-Chain-Length"] = str(length)
    return oa.chat.completions.with_raw_response.create(
        model="video",
        messages=[{"role": "user", "content": "a shot"}],
        extra_headers=headers,
        extra_body={"fake": fake},
    )


def as_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_film_sent_shot_by_shot_is_one_run_with_progress(gateway: Start, tmp_path: Path) -> None:
    gw = gateway(config(KEYS))
    alice, bob = client(gw, ALICE), client(gw, BOB)
    # Bob's film-1 is another chain: ids are per caller.
    shot(bob, "film-1", 9)
    first = [shot(alice, "film-1", 5, delay=0.3) for _ in range(2)]
    ids = [r.headers["x-request-id"] for r in first]
    # Shot 3 runs until the checks below are done (a fixed run could end during
    # them on a slow host), on a thread, as the producer waits for it.
    release = tmp_path / "release-shot-3"
    third: list[Any] = []
    producer = threading.Thread(
        target=lambda: third.append(shot(alice, "film-1", 5, hold_file=str(release)))
    )
    producer.start()
    try:
        with gw.client() as http:
            seen = poll(
                lambda: (
                    (c := http.get("/api/chains/film-1", headers=as_key(ALICE)).json())["progress"][
                        "running"
                    ]
                    == 1
                    and c
                ),
                "alice's third shot to run",
            )
            p = seen["progress"]
            assert (seen["caller"], seen["status"], seen["length"], seen["sent"]) == (
                "alice",
                "in_progress",
                5,
                3,
            )
            assert (p["total"], p["done"], p["failed"], p["running"], p["waiting"]) == (
                5,
                2,
                0,
                1,
                2,
            )
            assert p["basis"]["unqueued"] == 2 and p["estimated_finish_in_s"] > 0
            # Two shots not sent yet, one median run each after the running one.
            assert p["estimated_finish_in_s"] >= 2 * p["basis"]["run_s"]["video"]
            # The lane's history is the forecast's: an interval's early end, and no late
            # end yet (under 30 minutes of log, too little to extrapolate from).
            assert p["estimated_finish_low_in_s"] is not None
            assert 0 < p["estimated_finish_low_in_s"] <= p["estimated_finish_in_s"]
            assert p["estimated_finish_high_in_s"] is None
            assert p["basis"]["earlier_days"] == 0
            # Bob's film-1 is his own: one shot of nine.
            theirs = http.get("/api/chains/film-1", headers=as_key(BOB)).json()
            assert theirs["caller"] == "bob" and theirs["progress"]["done"] == 1
            assert theirs["progress"]["total"] == 9
            # The admin sees both, and names the caller when the id is ambiguous.
            both = http.get("/api/chains/film-1", headers=as_key(ADMIN))
            assert both.status_code == 409 and "?caller=" in both.json()["error"]["message"]
            boss = http.get("/api/chains/film-1?caller=alice", headers=as_key(ADMIN)).json()
            assert boss["caller"] == "alice" and boss["sent"] == 3
            listed = http.get("/api/chains", headers=as_key(ADMIN)).json()["data"]
            assert {c["caller"] for c in listed} == {"alice", "bob"}
            mine = http.get("/api/chains", headers=as_key(ALICE)).json()["data"]
            assert [c["caller"] for c in mine] == ["alice"]
            # The open chains are among /api/queue's runs: a user key sees its own.
            runs = http.get("/api/queue", headers=as_key(ALICE)).json()["runs"]
            assert [(r["object"], r["id"], r["caller"]) for r in runs] == [
                ("chain", "film-1", "alice")
            ]
            admin_runs = http.get("/api/queue", headers=as_key(ADMIN)).json()["runs"]
            assert {r["caller"] for r in admin_runs if r["object"] == "chain"} >= {"alice"}
            # A shot's explanation names its chain and its place.
            story = http.get(f"/api/requests/{ids[1]}/explain", headers=as_key(ALICE)).json()
            assert story["chain"]["id"] == "film-1" and story["chain"]["shot"] == 2
            assert story["chain"]["length"] == 5 and story["chain"]["progress"]["total"] == 5
        shown = subprocess.run(
            [sys.executable, "-m", "app.cli", "queue", "--url", gw.url, "--api-key", ALICE],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert shown.returncode == 0, shown.stderr
        assert "chain film-1 in_progress caller alice: 2/5 done, 1 running, 2 waiting" in (
            shown.stdout
        )
    finally:
        release.touch()
        producer.join()
    # Every shot's enqueue names its chain in the log, as the replay reads it.
    rows = gw.wait_for(
        "SELECT json_extract(data, '$.chain') AS chain, "
        "json_extract(data, '$.chain_length') AS length, json_extract(data, '$.caller') AS who "
        "FROM events WHERE type = 'request_enqueued' ORDER BY seq",
        count=4,
    )
    assert [(r["chain"], r["length"], r["who"]) for r in rows] == [
        ("film-1", 9, "bob"),
        *[("film-1", 5, "alice")] * 3,
    ]
    text = subprocess.run(
        [sys.executable, "-m", "app.cli", "explain", ids[1], "--db", str(gw.db)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert "shot 2 of 5 of chain film-1" in text.stdout, text.stdout + text.stderr
    # The replay reads the recorded chain (no guess), and the log verifies.
    replay = subprocess.run(
        [sys.executable, "-m", "tools.replay", str(gw.db), "--json", "--no-reference"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert replay.returncode == 0, replay.stderr
    meta = json.loads(replay.stdout)
    assert meta["chains"] == "recorded (X-Gpulane-Chain)"
    assert meta["chained"] >= 1  # shot 3 was sent after shot 2 ended (bob's has one shot)
    verify = subprocess.run(
        [sys.executable, "-m", "tools.replay", str(gw.db), "--verify"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with gw.client() as http:
        # Read from disk, where the last completion may still be on its way.
        ended = poll(
            lambda: (
                (p := http.get("/api/chains/film-1", headers=as_key(ALICE)).json()["progress"])[
                    "running"
                ]
                == 0
                and p
            ),
            "the third shot's completion",
        )
        assert (ended["done"], ended["running"], ended["waiting"]) == (3, 0, 2)
        other = http.get("/api/chains/nope", headers=as_key(ALICE))
        assert other.status_code == 404 and other.json()["error"]["code"] == "chain_not_found"


def test_durable_jobs_chain_too(gateway: Start) -> None:
    gw = gateway(config())
    with gw.client() as http:
        jobs = []
        for _ in range(3):
            r = http.post(
                "/v1/chat/completions",
                json={"model": "video", "messages": [], "fake": {"delay": 0.2}},
                headers={"Prefer": "respond-async", "X-Gpulane-Chain": "nightly"},
            )
            assert r.status_code == 202, r.text
            jobs.append(r.json()["id"])
        chain = poll(
            lambda: (c := http.get("/api/chains/nightly").json())["progress"]["done"] == 3 and c,
            "the three jobs to be done",
        )
        # No length given: the total is not known, and nothing is left once they end.
        assert chain["length"] is None and chain["progress"]["total"] is None
        assert chain["status"] == "ended" and chain["progress"]["waiting"] == 0
        story = http.get(f"/api/requests/{jobs[2]}/explain").json()
        assert story["chain"]["shot"] == 3 and story["chain"]["length"] is None


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"X-Gpulane-Chain": "x" * 200}, "X-Gpulane-Chain: "),
        ({"X-Gpulane-Chain": "film 1"}, "X-Gpulane-Chain: 'film 1'"),
        ({"X-Gpulane-Chain": "f", "X-Gpulane-Chain-Length": "0"}, "X-Gpulane-Chain-Length: '0'"),
        ({"X-Gpulane-Chain": "f", "X-Gpulane-Chain-Length": "2.5"}, "Chain-Length: '2.5'"),
    ],
)
def test_a_bad_chain_header_is_a_400_naming_it(
    gateway: Start, headers: dict[str, str], named: str
) -> None:
    gw = gateway(config())
    oa = client(gw, "none")
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model="video", messages=[], extra_headers=headers)
    error = caught.value.body
    assert isinstance(error, dict) and named in error["message"], error
    assert error["code"] in ("invalid_chain", "invalid_chain_length")
    # Nothing was queued; the rejection is in the log.
    rows = gw.wait_for("SELECT data FROM events WHERE type = 'request_rejected'")
    assert named in json.loads(rows[0]["data"])["error"]
    with httpx.Client(base_url=gw.url) as http:
        assert http.get("/api/chains").json()["data"] == []


def yesterdays_interactive_work(start_ns: int, hours: float) -> list[Any]:
    """A log of interactive requests on `video` from `start_ns` for `hours`: one
    every 5 minutes, each running 2 minutes (0.4 of the lane), as another
    caller's day would have left it."""
    d = CoreDriver(now_ns=start_ns)
    every_ns, run_s = 300 * NS_PER_S, 120.0
    for i in range(int(hours * 12)):
        d.at(start_ns - T0 + i * every_ns)
        rid = f"yesterday-{i}"
        d.enqueue(rid, "video", ALIASES["interactive"], caller="someone")
        dispatched = d.step()
        assert dispatched is not None
        if dispatched.swap:
            d.start_swap("video", rid)
            d.advance(NS_PER_S)
            d.apply(ev.SwapFinished(at=d.now, model="video", duration_ms=1000.0))
        d.apply(ev.RequestStarted(at=d.now, request_id=rid))
        d.advance(int(run_s * NS_PER_S))
        d.apply(ev.RequestCompleted(at=d.now, request_id=rid, http_status=200, run_ms=run_s * 1e3))
    return d.log


def test_a_chains_forecast_adds_the_work_that_overtook_it_on_earlier_days(
    tmp_path: Path,
) -> None:
    """Yesterday, around this hour, interactive work took 0.4 of the lane: a batch
    chain's finish today is forecast later than its own work alone, by the
    overtaking work the same hours of yesterday saw."""
    gw = Gateway(tmp_path, config())
    now = time.time_ns()
    # From 70 minutes before this time yesterday to 130 minutes after, so the
    # hour now and the next are covered whatever the minute.
    write_log(gw.db, yesterdays_interactive_work(now - 86400 * NS_PER_S - 70 * 60 * NS_PER_S, 3.3))
    gw.start()
    try:
        alice = client(gw, "any")
        for _ in range(2):
            shot(alice, "film-2", 5)
        with gw.client() as http:
            p = http.get("/api/chains/film-2").json()["progress"]
    finally:
        gw.stop()
    assert (p["done"], p["running"], p["waiting"]) == (2, 0, 3), p
    basis = p["basis"]
    assert basis["unqueued"] == 3 and basis["earlier_days"] == 1, basis
    # Its own work: three shots of the model's median run (yesterday's 2 minutes).
    own_s = 3 * basis["run_s"]["video"]
    assert own_s >= 3 * 100, basis
    # The overtaking work: shots of yesterday's rate at least, and a later finish.
    assert basis["overtaking"] >= 1, basis
    assert p["estimated_finish_in_s"] > 1.2 * own_s, (p, own_s)
    assert p["estimated_finish_low_in_s"] is not None and p["estimated_finish_high_in_s"]
    assert p["estimated_finish_low_in_s"] <= p["estimated_finish_in_s"]
    assert p["estimated_finish_in_s"] <= p["estimated_finish_high_in_s"]
