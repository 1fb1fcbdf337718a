"""A model whose upstream fails to start is loaded again only after a back-off
(`loadBackoff`, doubling), other models are served meanwhile, and after
`loadFailureLimit` failures in a row its waiting durable jobs fail with the
loader's error (app/core/load_backoff.py, docs/scheduling.md)."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.e2e.gateway import Gateway, fake_model, poll
from tests.e2e.log_replay import assert_log_replays, gpulane

Start = Callable[[str], Gateway]
ASYNC = {"Prefer": "respond-async", "X-LlamaSwap-Priority": "interactive"}


def config() -> str:
    models = (fake_model("broken", "--exit-at-start") + fake_model("A")).replace("\n", "\n  ")
    return f"loadBackoff: 1\nloadBackoffMax: 60\nloadFailureLimit: 3\nmodels:{models}\n"


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def test_failed_loads_back_off_then_fail_the_waiting_jobs_while_others_are_served(
    gateway: Start,
) -> None:
    gw = gateway(config())

    def failed_loads() -> list[float]:
        rows = gw.sql("SELECT at FROM events WHERE type = 'swap_failed' ORDER BY seq")
        return [float(r["at"]) for r in rows]

    with gw.client() as client:
        jobs = []
        for _ in range(5):
            r = client.post("/v1/chat/completions", json=chat("broken"), headers=ASYNC)
            assert r.status_code == 202, r.text
            jobs.append(r.json()["id"])
        # broken's jobs outrank A's request, yet A is served while broken backs off.
        poll(failed_loads, "a failed load")
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200

        def ended() -> dict[str, str]:
            views = [client.get(f"/v1/jobs/{job}").json() for job in jobs]
            if any(v["status"] != "failed" for v in views):
                return {}
            return {v["id"]: v["error"] for v in views}

        errors = poll(ended, "every job of broken to fail", timeout=30)
        # A job's view can come before the third load's failure is on disk.
        at = poll(lambda: len(failed_loads()) >= 3 and failed_loads(), "three failed loads")
        assert len(at) == 3, at  # no fourth load: nothing waits for broken any more
        assert at[1] - at[0] >= 1.0 and at[2] - at[1] >= 2.0, at  # 1 s, then 2 s
        given_up = [job for job in jobs if "loadFailureLimit 3" in errors[job]]
        assert len(given_up) == 2, errors  # three failed on their own loads
        # A was dispatched while broken backed off, not after its jobs ended.
        (row,) = gw.sql(
            "SELECT (SELECT min(seq) FROM events WHERE type = 'request_dispatched' "
            "AND model = 'A') AS a, (SELECT max(seq) FROM events WHERE type = 'swap_failed') AS f"
        )
        assert row["a"] < row["f"], dict(row)
        for job in jobs:
            assert "exited with code 3" in errors[job], errors[job]  # the loader's error
        assert client.post("/v1/chat/completions", json=chat("A")).status_code == 200
    # The story of a given-up job says why it waited.
    shown = gpulane("explain", given_up[-1], "--db", str(gw.db), "--json")
    assert shown.returncode == 0, shown.stderr
    story = json.loads(shown.stdout)
    assert story["failed_loads"] == 2
    assert "load_backoff" in [part["cause"] for part in story["wait"]]
    text = gpulane("explain", given_up[-1], "--db", str(gw.db)).stdout
    assert "while model broken backed off after 2 failed loads" in text
    gw.stop()
    check = gw.db_check()
    assert check.returncode == 0, check.stdout + check.stderr
    assert_log_replays(gw.db)
