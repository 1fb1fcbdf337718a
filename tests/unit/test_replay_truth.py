"""tools/replay/truth.py: the replay against ground truth (issue 22, item 1).

The log generated at the defaults, replayed at each point of a small grid, against
the log generated at that point. The bounds are what was measured (docs/replay.md,
"Checked against ground truth"), rounded up: a regression guard, not a goal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core import events as ev
from app.core.scoring import ScoringParams
from tools.replay.sweep import parse_grid
from tools.replay.truth import check, coverage, table, worst

MIN = 60.0
GRID = parse_grid(["fair=0,20", "short=0,20"], ScoringParams())

FILM_BOUNDS = {
    # band: (p50, p95, max) in seconds, clients who gave up; measured worst in comments
    # (`gpulane replay truth film --seeds 1,2,3 --no-reference`, the wait arrival to
    # dispatch; with each request's own swap counted as before: 30.3s, 2m42s, 20m52s,
    # 11 / 23.6s, 3m12s, 5m04s, 0 / 48.0s, 2m03s, 4m48s, 0)
    "interactive": (45.0, 3 * MIN, 22 * MIN, 12),  # 26.5s, 2m23s, 20m53s, 11
    "normal": (45.0, 4 * MIN, 6 * MIN, 0),  # 30.1s, 3m12s, 5m16s, 0
    "batch": (60.0, 3 * MIN, 6 * MIN, 0),  # 0.0s, 1m25s, 4m49s, 0
}


def test_film_seeds_1_to_3_replayed_against_ground_truth() -> None:
    comparisons = check("film", [1, 2, 3], GRID)
    assert len(comparisons) == 12
    errors = worst(comparisons)
    for band, (p50, p95, top, left) in FILM_BOUNDS.items():
        e = errors[band]
        assert e["wait_p50_s"] <= p50, (band, e)
        assert e["wait_p95_s"] <= p95, (band, e)
        assert e["wait_max_s"] <= top, (band, e)
        assert e["left"] <= left, (band, e)
    for model in ("flux-image", "qwen-chat", "wan-video"):
        assert errors[f"model {model}"]["wait_p95_s"] <= 4 * MIN  # measured 3m42s
    # The what-if: the defaults log replayed at fair=20 short=20. With the
    # log's own patience estimate the interactive p95 lands within 2 min of the truth
    # (measured +6s / +23s / +1m30s; -40s / +13s / +1m51s with each request's own
    # swap counted as wait; issue 22 measured -4m17s / -2m08s / -46s with the chat
    # leavers' median lent to image and video clients).
    target = ScoringParams(fair_share_bonus=20, short_job_bonus=20)
    at_target = [c for c in comparisons if c.params == target]
    assert sorted(c.seed for c in at_target) == [1, 2, 3]  # not vacuous: one per seed
    for c in at_target:
        assert abs(c.errors()["interactive"]["wait_p95_s"] or 0.0) <= 2 * MIN
        # ... and within the error the replay prints for that point (issue 22's goal).
        assert c.within()["interactive"]["wait_p95_s"] is True
    text = table(comparisons)
    assert "worst |predicted - true|" in text and "within predicted ± printed error" in text


def test_each_points_printed_error_holds_the_truth() -> None:
    """Issue 22, item 2: every point's error (the simulation error plus the farthest
    shaken run, `report.point_error`) checked against ground truth. Measured with
    `gpulane replay truth film --seeds 1,2,3 --no-reference` (4 points x 3 seeds,
    --shake 10), with the wait arrival to dispatch (app/core/wait.py): the truth lies
    within predicted ± printed error at 12 of 12 points on every band's left, on
    p50 at 12/11/12 (seed 1 short=20 normal: +22.4s against ±20.4s), on p95 at
    11/11/12 (seed 1 fair=20 interactive +2m23s against ±2m06s; seed 3 fair=20
    short=20 normal -2m19s against ±2m19s), and on the max at 12/11/12. A
    regression guard."""
    cover = coverage(check("film", [1, 2, 3], GRID))
    for band in ("interactive", "normal", "batch"):
        assert cover[band]["wait_p50_s"][0] >= 11, band
        assert cover[band]["left"] == (12, 12), band
        assert cover[band]["wait_p95_s"][0] >= 11, band
        assert cover[band]["wait_max_s"][0] >= 11, band
    for model in ("flux-image", "qwen-chat", "wan-video"):
        for figs in cover[f"model {model}"].values():
            assert figs[0] >= 11 and figs[1] == 12, (model, figs)


def test_the_fair_scenario_is_predicted_exactly() -> None:
    """Durable jobs (no patience to guess), one model: nothing for the replay to
    estimate, so every point is predicted exactly."""
    comparisons = check("fair", [1, 2, 3], GRID)
    errors = worst(comparisons)
    assert set(errors) == {"batch", "model wan-video"}
    for figs in errors.values():
        assert figs == {"wait_p50_s": 0.0, "wait_p95_s": 0.0, "wait_max_s": 0.0, "left": 0.0}
    for covered in coverage(comparisons).values():  # every prediction within its error
        assert all(hit == n == 12 for hit, n in covered.values()), covered


def test_the_truth_command(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.replay.cli import replay_command

    assert replay_command(["truth", "fair", "--seeds", "1", "--grid", "fair=0,20"]) == 0
    out = capsys.readouterr().out
    assert "fair seed 1, aging=60s bonus=10 fair=20" in out and "worst |predicted" in out
    assert "fair seed 1, fifo (x10) (reference)" in out
    assert replay_command(["truth", "fair", "--seeds", "1", "--no-reference"]) == 0
    assert "(reference)" not in capsys.readouterr().out
    assert replay_command(["truth", "fair", "--seeds", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"worst"' in out and '"printed_error"' in out and '"within"' in out
    bad_args = (
        ["--seeds", "one"],
        ["--grid", "colour=1"],
        ["--patience", "vip=1m"],
        ["--shake", "-1"],
        ["--fifo-concurrency", "0"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit) as exit_info:
            replay_command(["truth", "fair", *bad])
        assert exit_info.value.code == 2


def test_the_reference_policies_against_ground_truth() -> None:
    """The references the replay prints beside its grid, each run for real by the
    generator: arrival order (every request enqueued at priority 0, figures per band
    of the priority asked for), priority without aging, the fifo scheduler. Measured
    with `gpulane replay truth film --seeds 1,2,3` (docs/replay.md; the wait arrival
    to dispatch): arrival order's real interactive p95 is 21m02s / 20m40s / 20m40s
    against 15m26s / 16m50s / 14m56s with the defaults, its worst batch wait 43m06s on
    seed 1."""
    comparisons = check("film", [1], [ScoringParams()], references=True)
    assert [c.point for c in comparisons] == [
        "aging=60s bonus=10",
        "arrival order",
        "priority, no aging",
        "fifo (x10)",
    ]
    assert [c.reference for c in comparisons] == [False, True, True, True]
    by = {c.point: c for c in comparisons}
    defaults, arrival = by["aging=60s bonus=10"], by["arrival order"]
    for c in comparisons:  # every band keeps its requests, whatever was enqueued
        assert (
            c.true["bands"]["interactive"]["count"]
            == defaults.true["bands"]["interactive"]["count"]
        )
    assert arrival.true["bands"]["interactive"]["wait_p95_s"] == pytest.approx(21 * MIN + 2, abs=1)
    assert defaults.true["bands"]["interactive"]["wait_p95_s"] == pytest.approx(
        15 * MIN + 26, abs=1
    )
    assert arrival.true["bands"]["batch"]["wait_max_s"] == pytest.approx(43 * MIN + 5.5, abs=1)
    # The replay sees arrival order's cost too, though it overstates its p95 (the
    # log cannot tell how long chat clients wait past its longest chat wait).
    assert arrival.predicted["bands"]["interactive"]["wait_p95_s"] > 20 * MIN
    text = table(comparisons)
    assert "seed 1, arrival order (reference)" in text
    assert "over every seed and reference policy" in text


def test_generate_under_a_reference_policy() -> None:
    from app.core.state import FIFO
    from tools.replay.generate import fair, generate_events
    from tools.replay.simulate import Policy

    fifo = Policy("fifo", ScoringParams(0, 0), scheduler=FIFO, concurrency=10)
    events = generate_events(fair(1), ScoringParams(), policy=fifo)
    started = events[0]
    assert isinstance(started, ev.ServerStarted)
    assert started.scheduler == FIFO and set(started.concurrency.values()) == {10}
    arrival = Policy("arrival order", ScoringParams(0, 0), ignore_priority=True)
    events = generate_events(fair(1), ScoringParams(), policy=arrival)
    assert {e.priority for e in events if isinstance(e, ev.RequestEnqueued)} == {0}


def test_the_replays_pick_really_runs_under_12_minutes() -> None:
    """Issue 22's goal: on film seeds 1-3, with the settings the replay recommends
    (`*` of `--sweep fair=0,20 short=0,20,40 --shake 10`), interactive p95 as really
    run at most 12 minutes and the prediction within its printed error. Measured
    (`gpulane replay truth film --seeds 1,2,3 --grid fair=0,20 short=0,20,40`): the
    pick is fair=20 short=40 / short=40 / short=20, true 11m29s / 11m12s / 11m14s,
    predicted 11m13s ±2m10s / 11m22s ±4m00s / 12m50s ±3m00s."""
    grid = parse_grid(["fair=0,20", "short=0,20,40"], ScoringParams())
    comparisons = check("film", [1, 2, 3], grid)
    picks = [c for c in comparisons if c.recommended]
    assert [c.seed for c in picks] == [1, 2, 3]
    for c in picks:
        assert c.true["bands"]["interactive"]["wait_p95_s"] <= 12 * MIN, c.point
        assert c.within()["interactive"]["wait_p95_s"] is True, c.point
    assert "the replay's pick" in table(comparisons)


def test_a_second_gpu_against_ground_truth() -> None:
    """`--config`: each point again on other resources, predicted by the replay's
    several-lane simulation of the defaults log and generated through the core with
    that router. Measured (`gpulane replay truth film --seeds 1,2,3 --grid fair=0,20
    short=0,10,20,40 --config tools/replay/whatif/film-second-gpu.yaml`): chat on a
    GPU of its own brings interactive p95 to 3m08s / 4m06s / 4m14s (predicted
    4m08s ±2m10s / 4m54s ±1m56s / 4m39s ±1m55s), no interactive client leaving."""
    from tools.replay.generate import film
    from tools.replay.resources import load_resources

    second = load_resources(
        str(Path(__file__).parents[2] / "tools/replay/whatif/film-second-gpu.yaml"),
        film(1).workload.models,
    )
    comparisons = check("film", [1], [ScoringParams()], resources=[second])
    assert [c.point for c in comparisons] == [
        "aging=60s bonus=10",
        "aging=60s bonus=10 on film-second-gpu.yaml",
    ]
    lanes = comparisons[1].true["bands"]["interactive"]
    assert lanes["wait_p95_s"] == pytest.approx(3 * MIN + 8, abs=1) and lanes["left"] == 0
    assert comparisons[1].within()["interactive"]["wait_p95_s"] is True
    assert comparisons[1].recommended


def test_the_truth_command_refuses_a_config_without_the_scenarios_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.replay.cli import replay_command

    other = tmp_path / "other.yaml"
    other.write_text("models:\n  some-model:\n    cmd: server --port ${PORT}\n")
    assert replay_command(["truth", "film", "--seeds", "1", "--config", str(other)]) == 2
    assert "are not in it" in capsys.readouterr().err
