"""A batch's progress and estimated finish (issue 25, item 5): in
`GET /v1/batches/{id}` (`gpulane_progress`), `/api/queue` (`runs`),
`gpulane queue` and a line's explanation, through `gpulane serve`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from tests.e2e.gateway import REPO, Gateway, poll
from tests.e2e.test_batches import client, config, line, submit, wait_batch

Start = Callable[[str], Gateway]


def test_a_batch_says_how_far_it_is_and_when_it_should_end(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    # Run times are learnt from the log: two lines of 0.4 s first.
    warm = submit(oa, [line(f"warm{i}", delay=0.4) for i in range(2)])
    wait_batch(oa, warm.id, "completed")
    # Its second line is held until the checks are done: ten lines of 0.4 s could
    # all end on a loaded host before the run time is refreshed (every 2 s).
    release = gw.tmp / "release"
    shots = [line(f"shot-{i}", delay=0.4) for i in range(10)]
    shots[1] = line("shot-1", delay=0.4, hold_file=str(release))
    batch = submit(oa, shots)
    with gw.client() as http:
        seen = poll(
            lambda: (
                (p := http.get(f"/v1/batches/{batch.id}").json()["gpulane_progress"])["done"] >= 1
                and p["running"] == 1
                and p["basis"]["run_s"]["A"] > 0.3  # learnt (refreshed every 2 s)
                and p
            ),
            "a line done, one running, and the run time learnt",
        )
        assert seen["total"] == 10 and seen["failed"] == 0
        assert seen["done"] + seen["running"] + seen["waiting"] == 10
        basis = seen["basis"]
        assert basis["run_s"]["A"] < 1.5 and basis["ahead"] == 0
        # What is left: the running line's rest and a median run per waiting line.
        left = seen["waiting"] * basis["run_s"]["A"]
        assert left <= seen["estimated_finish_in_s"] <= left + basis["run_s"]["A"] + 0.1
        # A log of minutes has no earlier day to forecast from: the point is the
        # floor, the interval's low end at most that, its high end unknown.
        assert basis["earlier_days"] == 0 and basis["overtaking"] == 0
        assert seen["estimated_finish_low_in_s"] <= seen["estimated_finish_in_s"]
        assert seen["estimated_finish_low_at"] <= seen["estimated_finish_at"]
        assert seen["estimated_finish_high_at"] is None
        assert seen["estimated_finish_high_in_s"] is None
        queue = http.get("/api/queue").json()
        [run] = [r for r in queue["runs"] if r["id"] == batch.id] or [None]
        assert run is not None and run["progress"]["total"] == 10
        # The listing carries each batch's progress too (an open one's estimate).
        listed = {b["id"]: b["gpulane_progress"] for b in http.get("/v1/batches").json()["data"]}
        assert listed[warm.id] == {
            "total": 2,
            "done": 2,
            "failed": 0,
            "running": 0,
            "waiting": 0,
            "estimated_finish_at": None,
            "estimated_finish_in_s": None,
            "basis": None,
            "estimated_finish_low_at": None,
            "estimated_finish_high_at": None,
            "estimated_finish_low_in_s": None,
            "estimated_finish_high_in_s": None,
            "estimated_finish_open": False,
        }
        assert listed[batch.id]["total"] == 10
        assert listed[batch.id]["estimated_finish_at"] or listed[batch.id]["waiting"] == 0
        job = http.get("/v1/jobs?limit=1").json()["data"][0]
        story = http.get(f"/api/requests/{job['id']}/explain").json()
        assert story["batch"]["id"] == batch.id and story["batch"]["progress"]["total"] == 10
    shown = subprocess.run(
        [sys.executable, "-m", "app.cli", "queue", "--url", gw.url],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"batch {batch.id} in_progress" in shown.stdout
    release.touch()
    done = wait_batch(oa, batch.id, "completed")
    with gw.client() as http:
        final = http.get(f"/v1/batches/{done.id}").json()["gpulane_progress"]
    assert (final["done"], final["failed"], final["waiting"], final["running"]) == (10, 0, 0, 0)
    assert final["estimated_finish_at"] is None
    [listed_final] = [b for b in oa.batches.list() if b.id == done.id]
    assert listed_final.model_extra["gpulane_progress"] == final  # the same, from its counts


def test_gpulane_queue_shows_an_open_batch_with_its_eta(gateway: Start) -> None:
    gw = gateway(config())
    oa = client(gw)
    # The first line runs until `gpulane queue` has answered: a fixed run could
    # end first on a slow host, where the command takes seconds to start.
    release = gw.tmp / "release"
    batch = submit(oa, [line("slow", hold_file=str(release))] + [line(f"w{i}") for i in range(3)])
    try:
        with gw.client() as http:
            poll(
                lambda: http.get(f"/v1/batches/{batch.id}").json()["gpulane_progress"]["running"],
                "its first line to run",
            )
        shown = subprocess.run(
            [sys.executable, "-m", "app.cli", "queue", "--url", gw.url],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
    finally:
        release.touch()
    assert shown.returncode == 0, shown.stderr
    assert f"batch {batch.id} in_progress" in shown.stdout
    # No run of A has ended yet: when the first line ends is not known, and the
    # finish is said to be the earliest it can be (issue 39), not made up.
    assert "0/4 done, 1 running, 3 waiting, 0 failed; ends after " in shown.stdout
    assert "at the earliest" in shown.stdout
