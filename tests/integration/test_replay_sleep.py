"""`replay --what-if sleep=MODEL`: what if a model slept instead of stopping (issue 43),
on a generated log, and the stateful swap cost it runs with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core import events as ev
from app.core.swap_costs import ActionCosts
from tools.replay.cli import replay_command
from tools.replay.sleep_whatif import WhatIfError, learnt_costs, parse_costs, sleeping_cost

S = 1_000_000_000


@pytest.fixture(scope="module")
def film_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("sleep") / "film.db"
    assert replay_command(["generate", "film", "--out", str(db), "--seed", "2"]) == 0
    return db


def test_sleeping_costs_a_sleep_out_and_a_wake_in_after_the_first_cold_load() -> None:
    base = lambda a, b: (2 * S, 20 * S)  # noqa: E731  (today: stop 2 s, cold 20 s)
    costs = {m: ActionCosts(sleep_ns=S // 2, wake_ns=S) for m in ("a", "b")}
    cost = sleeping_cost(base, ["a"], costs)
    assert cost(None, "a") == (2 * S, 20 * S)  # nothing to evict: base's unload
    assert cost("a", "b") == (S // 2, 20 * S)  # a sleeps; b (never sleeps) cold-starts
    assert cost("b", "a") == (2 * S, S)  # b stops; a wakes
    assert cost("a", "b") == (S // 2, 20 * S)


def test_what_if_a_model_slept(film_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(film_db), "--what-if", "sleep=flux-image,wan-video", "--json"]
    args += ["--costs", "flux-image=sleep:0.5,wake:1", "--costs", "wan-video=sleep:0.5,wake:1"]
    assert replay_command(args) == 0
    out = json.loads(capsys.readouterr().out)
    today, slept, arrival_today, arrival_slept = out["runs"]
    assert today["label"].endswith("stop and cold start") and "sleep" in slept["label"]
    assert arrival_today["label"].startswith("arrival order")
    assert slept["swap_s"] < today["swap_s"] / 2
    assert slept["busy_share"] > today["busy_share"]
    assert out["costs_s"]["flux-image"]["wake"] == 1.0
    assert out["costs_s"]["flux-image"]["start"] > 10  # the log's cold starts


def test_bad_what_ifs_say_what_is_allowed(
    film_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay_command([str(film_db), "--what-if", "sleep=nope"]) == 2
    assert "nope is not one of the log's models" in capsys.readouterr().err
    assert replay_command([str(film_db), "--what-if", "sleep=flux-image"]) == 2
    assert "the log has no sleep and wake of flux-image" in capsys.readouterr().err
    with pytest.raises(WhatIfError, match="is not KIND:SECONDS"):
        parse_costs(["m=nap:1"])


def test_learnt_costs_take_the_logs_and_given_ones_win() -> None:
    log: list[ev.AnyEvent] = [
        ev.ProcessSlept(at=S, model="m", pid=1, duration_ms=700.0),
        ev.ProcessWoken(at=2 * S, model="m", pid=1, duration_ms=1500.0),
    ]
    costs = learnt_costs(log, {"m": ActionCosts(wake_ns=S)})
    assert costs["m"] == ActionCosts(sleep_ns=700_000_000, wake_ns=S)
