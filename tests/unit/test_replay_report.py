"""tools/replay/report.py: per-caller, per-model and chain figures, fairness, the
simulation's error and when a parameter set earns its `*`."""

from __future__ import annotations

import copy
import csv
import io
from typing import Any

import pytest

from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.report import figures, judge, table, to_csv
from tools.replay.simulate import Policy, simulate
from tools.replay.workload import Request, SwapTimes, Workload

S = NS_PER_S
T0 = 1_700_000_000 * S


def req(rid: str, at_s: float, run_s: float, model: str = "A", **kw: object) -> Request:
    return Request(rid, model, -100, T0 + round(at_s * S), round(run_s * S), **kw)  # type: ignore[arg-type]


def run(*requests: Request) -> dict[str, Any]:
    w = Workload(requests=list(requests), swap_times=SwapTimes(), params=ScoringParams())
    result = simulate(w, Policy("p", ScoringParams(0, 0)))
    return figures(w, result, label="p", kind="simulated", params=None, scheduler="serial")


def test_waits_per_caller_and_model_with_each_callers_first_start_and_last_finish() -> None:
    f = run(
        req("a1", 0, 100, caller="a"),
        req("a2", 0, 100, caller="a"),
        req("b1", 10, 50, "B", caller="b"),
    )
    a, b = f["callers"]["a"], f["callers"]["b"]
    assert (a["count"], a["wait_p50_s"], a["wait_max_s"]) == (2, 0.0, 100.0)
    assert (a["first_start_s"], a["last_finish_s"]) == (0.0, 200.0)
    # b arrives at 10 s, starts when a2 ends at 200 s, finishes at 250 s.
    assert (b["first_start_s"], b["last_finish_s"]) == (190.0, 240.0)
    assert f["models"]["B"]["wait_p95_s"] == 190.0
    assert f["models"]["A"]["count"] == 2


def test_fairness_is_jains_index_of_the_callers_mean_slowdown() -> None:
    even = run(req("a", 0, 100, caller="a"), req("b", 0, 100, "B", caller="b"))
    # Slowdowns 1 (a) and 2 (b, waited 100 s for 100 s of work): 9 / (2 x 5) = 0.9.
    assert even["bands"]["batch"]["fairness"] == 0.9
    alone = run(req("a1", 0, 100, caller="a"), req("a2", 0, 100, caller="a"))
    assert alone["bands"]["batch"]["fairness"] == 1.0  # one caller is always fair to itself


def test_a_chain_takes_from_its_first_arrival_to_its_last_end() -> None:
    f = run(
        req("blocker", 0, 30),
        req("shot1", 1, 10, caller="render"),
        req("shot2", 99, 10, caller="render", after=1, think_ns=2 * S),
    )
    # shot1 runs 30..40 s, shot2 arrives at 42 s and ends at 52 s: 51 s after 1 s.
    assert f["chains"] == {
        "count": 1,
        "requests": 2,
        "completion_p50_s": 51.0,
        "completion_max_s": 51.0,
    }


# -- the error and the mark ---------------------------------------------------------------


def row(label: str, kind: str, p95: float, worst: float, left: int, width: float = 0.0) -> Any:
    bands: dict[str, Any] = {
        "interactive": {
            "count": 100,
            "left": left,
            "wait_p50_s": 1.0,
            "wait_p95_s": p95,
            "wait_p99_s": p95,
            "wait_max_s": worst,
            "slowdown": 2.0,
            "fairness": 0.9,
        },
        **{
            b: {
                "count": 0,
                "left": 0,
                **dict.fromkeys(("wait_p50_s", "wait_p95_s", "wait_p99_s", "wait_max_s"), None),
                "slowdown": None,
                "fairness": None,
            }
            for b in ("normal", "batch")
        },
    }
    r: dict[str, Any] = {
        "label": label,
        "kind": kind,
        "bands": bands,
        "best": False,
        "callers": {},
        "models": {},
        "chains": {"count": 0, "requests": 0, "completion_p50_s": None, "completion_max_s": None},
        "swaps": 0,
        "swap_s": 0.0,
        "idle_s": 0.0,
        "makespan_s": 0.0,
        "reorders": {},
        "worst_wait_s": worst,
        "worst_wait_band": "interactive",
    }
    if width:
        spread = {"min": p95 - width / 2, "max": p95 + width / 2, "mean": p95}
        r["spread"] = {"bands": {"interactive": {"wait_p95_s": spread}}}
    return r


BASE = "aging=60s bonus=10 (recorded)"


def rows(candidate_p95: float, width: float) -> list[Any]:
    return [
        row("recorded", "recorded", 600, 1200, 5),
        row(BASE, "simulated", 660, 1200, 5, width),  # 60 s off the recorded p95
        row("candidate", "simulated", candidate_p95, 1200, 5, width),
    ]


@pytest.mark.parametrize(
    ("candidate_p95", "width", "marked"),
    [
        (500, 30, True),  # 160 s better: beyond the 60 s error and the 30 s spread
        (630, 10, False),  # 30 s better: within the error
        (500, 200, False),  # within the spread
        (500, 0, False),  # no --shake: no spread known, nothing marked
    ],
)
def test_a_set_is_marked_only_when_its_gain_beats_the_error_and_the_spread(
    candidate_p95: float, width: float, marked: bool
) -> None:
    runs = rows(candidate_p95, width)
    error = judge(runs, BASE)
    assert error["interactive"]["wait_p95_s"] == 60.0
    assert error["interactive"]["left"] == 0
    assert runs[2]["best"] is marked
    assert not runs[1]["best"] and not runs[0]["best"]


def test_a_set_worse_beyond_the_noise_on_any_figure_is_not_marked() -> None:
    runs = rows(500, 30)
    runs[2]["bands"]["interactive"]["left"] = 9  # 4 more clients lost, the error is 0
    judge(runs, BASE)
    assert not runs[2]["best"]
    assert runs[2]["beyond_noise"] == {
        "better": ["interactive wait_p95_s"],
        "worse": ["interactive left"],
    }


def test_the_table_shows_the_error_and_no_bound_and_csv_carries_every_group() -> None:
    runs = rows(500, 30)
    error = judge(runs, BASE)
    text = table(runs, error=error)
    assert "bound" not in text and "EXCEEDED" not in text
    assert "simulation error" in text and "interactive p95 1m00s" in text
    assert "* candidate" in text and "more than both its error" in text
    assert "500.0s ±1m15s" not in text and "8m20s ±1m15s" in text  # 60 s error + 15 s
    unmarked = copy.deepcopy(rows(630, 10))
    assert "no * :" in table(unmarked, error=judge(unmarked, BASE))
    real = run(req("a", 0, 10, caller="a"), req("b", 0, 10, "B", caller="b"))
    line = next(csv.DictReader(io.StringIO(to_csv([real]))))
    assert line["callers_b_wait_max_s"] == "10.0"
    assert line["models_B_count"] == "1"
    assert line["batch_fairness"]


def test_a_percentile_on_a_tie_says_so() -> None:
    """Issue 22: the film's batch p50 flips between 0.0s and about 1m as 85-88 of 174
    shots wait 0. Four of seven requests here wait 0: the p50 (rank 4) is on that tie."""
    f = run(*(req(f"r{i}", 0 if i < 4 else 10 * i, 5, f"M{i}") for i in range(7)))
    band = f["bands"]["batch"]
    assert band["wait_p50_s"] == 0.0
    assert band["ties"] == {"wait_p50_s": 0.571}  # 4 of 7 wait <= 0.0s
    text = table([f])
    assert "(tie: 57% <= " in text
    unique = run(req("a", 0, 5), req("b", 0, 5), req("c", 0, 5))  # waits 0, 5, 10 s
    assert "ties" not in unique["bands"]["batch"]


def test_the_worst_wait_takes_its_band_and_range_from_the_same_figure() -> None:
    """The trace's worst is interactive; a shaken run's worst may be in another band:
    the range printed beside it is the interactive max's, not the worst over bands."""
    r = row("candidate", "simulated", 500, 1200, 5)
    r["spread"] = {
        "worst_wait_s": {"min": 1100.0, "max": 4000.0, "mean": 2000.0},  # batch in one run
        "bands": {"interactive": {"wait_max_s": {"min": 1100.0, "max": 1300.0, "mean": 1200}}},
    }
    lines = table([r]).splitlines()
    line = lines[next(i for i, x in enumerate(lines) if "worst wait" in x) + 1]
    assert "interactive 20m00s (18m20s-21m40s)" in line and "1h06m" not in line


def test_durations_read_as_durations() -> None:
    from tools.replay.report import duration

    assert [duration(x) for x in (None, 8.24, 245.0, 3599.4, 3599.6, 7440.0)] == [
        "-",
        "8.2s",
        "4m05s",
        "59m59s",
        "1h00m",  # never 60m00s
        "2h04m",
    ]
