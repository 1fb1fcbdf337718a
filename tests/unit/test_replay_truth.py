"""tools/replay/truth.py: the replay against ground truth (issue 22, item 1).

The log generated at the defaults, replayed at each point of a small grid, against
the log generated at that point. The bounds are what was measured (docs/replay.md,
"Checked against ground truth"), rounded up: a regression guard, not a goal.
"""

from __future__ import annotations

import pytest

from app.core.scoring import ScoringParams
from tools.replay.sweep import parse_grid
from tools.replay.truth import check, coverage, table, worst

MIN = 60.0
GRID = parse_grid(["fair=0,20", "short=0,20"], ScoringParams())

FILM_BOUNDS = {
    # band: (p50, p95, max) in seconds, clients who gave up; measured worst in comments
    "interactive": (45.0, 3 * MIN, 22 * MIN, 12),  # 30.3s, 2m42s, 20m52s, 11
    "normal": (45.0, 4 * MIN, 6 * MIN, 0),  # 23.6s, 3m12s, 5m04s, 0
    "batch": (60.0, 3 * MIN, 6 * MIN, 0),  # 48.0s, 2m03s, 4m48s, 0
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
        assert errors[f"model {model}"]["wait_p95_s"] <= 4 * MIN  # measured 3m44s
    # The what-if: the defaults log replayed at fair=20 short=20. With the
    # log's own patience estimate the interactive p95 lands within 2 min of the truth
    # (measured -40s / +13s / +1m51s; issue 22 measured -4m17s / -2m08s / -46s with
    # the chat leavers' median lent to image and video clients).
    target = ScoringParams(fair_share_bonus=20, short_job_bonus=20)
    for c in comparisons:
        if c.params == target:
            assert abs(c.errors()["interactive"]["wait_p95_s"] or 0.0) <= 2 * MIN
            # ... and within the error the replay prints for that point (issue 22's goal).
            assert c.within()["interactive"]["wait_p95_s"] is True
    text = table(comparisons)
    assert "worst |predicted - true|" in text and "within predicted ± printed error" in text


def test_each_points_printed_error_holds_the_truth() -> None:
    """Issue 22, item 2: every point's error (the simulation error plus the farthest
    shaken run, `report.point_error`) checked against ground truth. Measured with
    `gpulane replay truth film --seeds 1,2,3` (4 points x 3 seeds, --shake 10): the
    truth lies within predicted ± printed error at 12 of 12 points on every band's
    p50 and left, at 11 of 12 on every band's p95 (seed 1 fair=20 interactive: +2m42s
    against ±2m41s; seed 3 fair=20 short=20 normal -2m19s against ±2m19s, batch
    -1m36s against ±1m33s), and 12/11/12 on the max. A regression guard."""
    cover = coverage(check("film", [1, 2, 3], GRID))
    for band in ("interactive", "normal", "batch"):
        assert cover[band]["wait_p50_s"] == (12, 12), band
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
    for figs in coverage(comparisons).values():  # every prediction within its error
        assert all(hit == n == 12 for hit, n in figs.values()), figs


def test_the_truth_command(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.replay.cli import replay_command

    assert replay_command(["truth", "fair", "--seeds", "1", "--grid", "fair=0,20"]) == 0
    out = capsys.readouterr().out
    assert "fair seed 1, aging=60s bonus=10 fair=20" in out and "worst |predicted" in out
    assert replay_command(["truth", "fair", "--seeds", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"worst"' in out and '"printed_error"' in out and '"within"' in out
    bad_args = (
        ["--seeds", "one"],
        ["--grid", "colour=1"],
        ["--patience", "vip=1m"],
        ["--shake", "-1"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit) as exit_info:
            replay_command(["truth", "fair", *bad])
        assert exit_info.value.code == 2
