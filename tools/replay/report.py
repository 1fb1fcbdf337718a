"""Figures of a run, how far the simulation is from the log, and the table / JSON /
CSV that compare runs side by side.

Wait is the one definition (app/core/wait.py): from arrival to dispatch (its own
swap comes after), or, for a client that left, until it left. Per band: count,
clients that left (never started), wait p50/p95/p99/max (nearest rank) over the
requests that ran, mean bounded slowdown (time to start + run) / max(run, 10 s)
over the requests that ran, and fairness: Jain's index
of the per-caller mean slowdowns, (sum x)^2 / (n sum x^2), 1 when every caller of
the band is slowed down alike, 1/n when one caller takes all of it. Per caller and
per model: count, left, wait p50/p95/max; per caller also its first start and last
finish, counted from its first arrival. Chains: how long each chain took, from its
first request's arrival to its last request's end. Overall: swaps, time spent
swapping, GPU idle time (nothing loading or running between the first arrival and
the last end), makespan and reorders by reason.

There is no starvation bound: the one printed before left out the backlog with
higher keys and the swaps ahead (docs/replay.md shows a trace far beyond it).

`judge` compares the simulated parameter sets with the simulated run of the recorded
parameters (the baseline). The simulation's error is how far that baseline is from
the recorded run, per band (p95 and worst wait, left, fairness). Each simulated run's
own error on a figure (`point_error`) is that simulation error plus the farthest its
shaken runs (`--shake`: what the replay estimated drawn again) lie from its printed
value. A parameter set gets `*` only when on some judged figure it beats the baseline
by more than both its error and the baseline's, is worse beyond them on none, and is
the best such set by `objective`. Without --shake no run has an error and nothing is
marked.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, TypeVar

from app.core.policy import REORDER_REASONS
from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.workload import RunResult, Workload

BANDS = ("interactive", "normal", "batch")
SLOWDOWN_FLOOR_NS = 10 * NS_PER_S
NO_CALLER = "(none)"
"""How a request without a caller label is grouped."""
Figures = dict[str, Any]
_T = TypeVar("_T")


@dataclass(slots=True)
class _Groups:
    """Request indices by band, caller and model, and the chains (kept for the last
    workload seen, since a sweep computes figures of many runs of one workload)."""

    bands: dict[str, list[int]]
    band_callers: dict[str, dict[str, list[int]]]
    callers: dict[str, list[int]]
    models: dict[str, list[int]]
    chains: list[list[int]]
    """Each chain's requests, first to last."""
    run_ns: list[int]
    slowdown_floor: list[int]
    """Each request's max(run, SLOWDOWN_FLOOR_NS): its bounded slowdown's divisor."""


_GROUPS: list[tuple[Workload, _Groups]] = []


def _groups(workload: Workload) -> _Groups:
    if _GROUPS and _GROUPS[0][0] is workload:
        return _GROUPS[0][1]
    runs = [r.run_ns for r in workload.requests]
    floors = [max(run, SLOWDOWN_FLOOR_NS) for run in runs]
    g = _Groups({b: [] for b in BANDS}, {b: {} for b in BANDS}, {}, {}, [], runs, floors)
    succ: dict[int, int] = {}
    for i, r in enumerate(workload.requests):
        band = band_of(r.priority)
        caller = r.caller or NO_CALLER
        g.bands[band].append(i)
        g.band_callers[band].setdefault(caller, []).append(i)
        g.callers.setdefault(caller, []).append(i)
        g.models.setdefault(r.model, []).append(i)
        if r.after >= 0:
            succ[r.after] = i
    for i, r in enumerate(workload.requests):
        if r.after < 0 and i in succ:
            chain = [i]
            while chain[-1] in succ:
                chain.append(succ[chain[-1]])
            g.chains.append(chain)
    _GROUPS[:] = [(workload, g)]
    return g


def figures(
    workload: Workload,
    result: RunResult,
    *,
    label: str,
    kind: str,
    params: ScoringParams | None,
    scheduler: str,
    quantiles: bool = False,
) -> Figures:
    """Every figure of one run, as plain JSON-able values (seconds). `quantiles` adds
    each band's wait at every percentile 0..100 (for plots)."""
    start = result.start_ns
    end = result.end_ns
    arrival = result.arrival_ns
    g = _groups(workload)
    # The figures are over the requests that ran: a leaver's wait is its patience.
    wait = [w if s >= 0 else -1 for w, s in zip(result.wait_ns, start, strict=True)]
    # Response time over run: from arrival to the start on a loaded model, then the run.
    slow = [
        (s - a + run) / floor if s >= 0 else -1.0
        for s, a, run, floor in zip(start, arrival, g.run_ns, g.slowdown_floor, strict=True)
    ]

    def waits_of(members: list[int]) -> list[int]:
        ws = sorted(_at(wait, members))
        return ws[bisect.bisect_left(ws, 0) :]  # -1: still waiting at the end

    def left_of(members: list[int]) -> int:
        return sum(1 for s in _at(start, members) if s < 0)

    def mean_slowdown(members: list[int]) -> float | None:
        xs = _at(slow, members)
        left = xs.count(-1.0)  # those who left: counted and summed in C, then taken out
        return (sum(xs) + left) / (len(xs) - left) if len(xs) > left else None

    bands: dict[str, Any] = {}
    curves: dict[str, list[float | None]] = {}
    worst, worst_band = -1, ""
    for band in BANDS:
        members = g.bands[band]
        ws = waits_of(members)
        if quantiles and ws:
            curves[band] = [_s(ws[0]), *(_s(_pct(ws, p)) for p in range(1, 101))]
        sd = mean_slowdown(members)
        per_caller = [mean_slowdown(m) for m in g.band_callers[band].values()]
        bands[band] = {
            "count": len(members),
            "left": left_of(members),
            **_wait_figures(ws, p99=True),
            "slowdown": None if sd is None else round(sd, 3),
            "fairness": _jain([x for x in per_caller if x is not None]),
        }
        if ws and ws[-1] > worst:
            worst, worst_band = ws[-1], band
    callers: dict[str, Any] = {}
    for caller, members in sorted(g.callers.items()):
        ws = waits_of(members)
        first = min(_at(arrival, members))
        first_start = min(filter(_started, _at(start, members)), default=None)
        last_end = max(_at(end, members))
        sd = mean_slowdown(members)
        callers[caller] = {
            "count": len(members),
            "left": left_of(members),
            **_wait_figures(ws),
            "slowdown": None if sd is None else round(sd, 3),
            "first_start_s": _s(None if first_start is None else first_start - first),
            "last_finish_s": _s(last_end - first if last_end >= 0 else None),
        }
    models: dict[str, Any] = {}
    for model, members in sorted(g.models.items()):
        ws = waits_of(members)
        models[model] = {"count": len(members), "left": left_of(members), **_wait_figures(ws)}
    took = sorted(
        max(ends) - arrival[chain[0]]
        for chain in g.chains
        if (ends := [end[i] for i in chain if end[i] >= 0])
    )
    chains = {
        "count": len(g.chains),
        "requests": sum(len(c) for c in g.chains),
        "completion_p50_s": _s(_pct(took, 50)),
        "completion_max_s": _s(took[-1] if took else None),
    }
    makespan = max(0, result.last_ns - result.first_ns)
    row: Figures = {
        "label": label,
        "kind": kind,
        "scheduler": scheduler,
        "aging_divisor_s": None if params is None else params.aging_divisor_ns / NS_PER_S,
        "swap_affinity_bonus": None if params is None else params.swap_affinity_bonus,
        "fair_share_bonus": None if params is None else params.fair_share_bonus,
        "short_job_bonus": None if params is None else params.short_job_bonus,
        "bands": bands,
        "callers": callers,
        "models": models,
        "chains": chains,
        "swaps": result.swaps,
        "swap_s": _s(result.swap_ns),
        "idle_s": _s(max(0, makespan - result.busy_ns)),
        # The lane's busy share: running work (not loading) over the span.
        "busy_share": (
            round(max(0, result.busy_ns - result.swap_ns) / makespan, 4) if makespan else None
        ),
        "makespan_s": _s(makespan),
        "reorders": dict(result.reorders),
        "worst_wait_s": _s(worst if worst >= 0 else None),
        "worst_wait_band": worst_band or None,
        "best": False,
    }
    if quantiles:
        row["quantiles"] = curves
    return row


def _at(values: Sequence[_T], members: list[int]) -> Sequence[_T]:
    """`values` at the indices `members`, gathered in C (a sweep asks for every
    run's figures)."""
    if len(members) > 1:
        return itemgetter(*members)(values)  # type: ignore[no-any-return]
    return [values[i] for i in members]


def _started(ns: int) -> bool:
    return ns >= 0  # -1: never started


TIE_SHARE = 0.05
"""A percentile falls on a tie when its value is the wait of at least this share of
the group (two requests at least): a few requests moving across it flip the figure
(the film's batch p50 is 0.0s or about 1m as 85-88 of its 174 shots wait 0)."""


def _wait_figures(ws: list[int], p99: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"wait_p50_s": _s(_pct(ws, 50)), "wait_p95_s": _s(_pct(ws, 95))}
    if p99:
        out["wait_p99_s"] = _s(_pct(ws, 99))
    out["wait_max_s"] = _s(ws[-1] if ws else None)
    ties = {}
    for key, p in (("wait_p50_s", 50), ("wait_p95_s", 95), ("wait_p99_s", 99)):
        if key in out and (share := _tie(ws, p)) is not None:
            ties[key] = share
    if ties:
        out["ties"] = ties
    return out


def _tie(ws: list[int], p: float) -> float | None:
    """When the p-th percentile of `ws` (sorted) falls on a tie: the share of `ws` at
    or below its value (so "51% wait <= 0.0s"); else None."""
    v = _pct(ws, p)
    if v is None:
        return None
    lo, hi = bisect.bisect_left(ws, v), bisect.bisect_right(ws, v)
    if hi - lo < max(2, TIE_SHARE * len(ws)):
        return None
    return round(hi / len(ws), 3)


def _jain(xs: list[float]) -> float | None:
    """Jain's fairness index of `xs`: 1 when all equal, 1/n when one takes all."""
    if not xs:
        return None
    square = sum(x * x for x in xs)
    return round(sum(xs) ** 2 / (len(xs) * square), 3) if square else 1.0


def _pct(sorted_values: Sequence[int], p: float) -> int | None:
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / NS_PER_S, 3)


# -- the simulation's error, and choosing the best candidate -------------------------

JUDGED = ("wait_p95_s", "wait_max_s", "left", "fairness")
"""The per-band figures the error is shown for and gains are measured on."""
HIGHER_IS_BETTER = frozenset({"fairness"})


def objective(row: Figures) -> tuple[float, float, float]:
    """Lower is better: interactive p95 wait, then worst batch wait, then mean slowdown.
    With --shake, each is its mean over the trace and its perturbed copies."""
    bands = row["bands"]
    served = {b: f["count"] - f["left"] for b, f in bands.items()}
    total = sum(served.values()) or 1
    slow = sum((_value(row, b, "slowdown") or 0.0) * n for b, n in served.items()) / total
    return (
        _value(row, "interactive", "wait_p95_s") or 0.0,
        _value(row, "batch", "wait_max_s") or 0.0,
        slow,
    )


def _value(row: Figures, band: str, key: str) -> float | None:
    """A band's figure: its mean over the shaken copies when there are some."""
    mean = (row.get("spread", {}).get("bands", {}).get(band, {}).get(key) or {}).get("mean")
    v = mean if mean is not None else row["bands"][band][key]
    return None if v is None else float(v)


ERROR_KEYS = ("wait_p50_s", *JUDGED)
"""The figures each simulated run gets an error for (per band, and per model without
fairness)."""
_MODEL_KEYS = ("wait_p50_s", "wait_p95_s", "wait_max_s", "left")


def simulation_error(
    recorded: Figures, baseline: Figures, keys: Sequence[str] = JUDGED
) -> dict[str, dict[str, float]]:
    """Per band with requests: |simulated with the recorded parameters - recorded|."""
    return {
        band: _differences(recorded["bands"][band], baseline["bands"][band], keys)
        for band in BANDS
        if recorded["bands"][band]["count"]
    }


def _differences(a: dict[str, Any], b: dict[str, Any], keys: Sequence[str]) -> dict[str, float]:
    return {
        k: round(abs(a[k] - b[k]), 3) if a.get(k) is not None and b.get(k) is not None else 0.0
        for k in keys
    }


def point_error(row: Figures, recorded: Figures, baseline: Figures) -> dict[str, Any]:
    """A simulated run's error on each figure, per band and per model: the simulation
    error of that figure (the baseline against the recorded run) plus the farthest any
    shaken run (`--shake`: what the replay estimated drawn again) lies from the
    printed value. {} without shaken runs: the spread is unknown."""
    if "spread" not in row:
        return {}

    def of(group: str, name: str, keys: Sequence[str]) -> dict[str, float]:
        mine = row[group].get(name, {})
        sim = _differences(recorded[group].get(name, {}), baseline[group].get(name, {}), keys)
        sp = row["spread"].get(group, {}).get(name, {})
        out = {}
        for k in keys:
            v, bounds = mine.get(k), sp.get(k) or {}
            far = 0.0
            if v is not None and "min" in bounds:
                far = max(bounds["max"] - v, v - bounds["min"])
            out[k] = round(sim[k] + far, 3)
        return out

    return {
        "bands": {b: of("bands", b, ERROR_KEYS) for b in BANDS if recorded["bands"][b]["count"]},
        "models": {m: of("models", m, _MODEL_KEYS) for m in recorded["models"]},
    }


def _error(row: Figures, band: str, key: str) -> float:
    return float(row.get("error", {}).get("bands", {}).get(band, {}).get(key, 0.0))


def judge(rows: list[Figures], baseline_label: str) -> dict[str, Any]:
    """The simulation's error (against the `recorded` row), each simulated or
    reference run's error (`point_error`, as `error`), and each simulated row's gains
    over the baseline; marks the best row whose gain beats its error and the
    baseline's. Returns the simulation error (empty without a recorded row)."""
    recorded = next((r for r in rows if r["kind"] == "recorded"), None)
    baseline = next((r for r in rows if r["label"] == baseline_label), None)
    if recorded is None or baseline is None:
        return {}
    error = simulation_error(recorded, baseline)
    for row in rows:
        if row["kind"] != "recorded" and (errs := point_error(row, recorded, baseline)):
            row["error"] = errs
    shaken = "spread" in baseline
    winners = []
    for row in rows:
        if row["kind"] != "simulated" or row is baseline:
            continue
        better, worse = [], []
        for band in error:
            for key in JUDGED:
                mine, base = row["bands"][band][key], baseline["bands"][band][key]
                if mine is None or base is None:
                    continue
                gain = (mine - base) if key in HIGHER_IS_BETTER else (base - mine)
                noise = max(error[band][key], _error(row, band, key), _error(baseline, band, key))
                if gain > noise:
                    better.append(f"{band} {key}")
                elif -gain > noise:
                    worse.append(f"{band} {key}")
        row["beyond_noise"] = {"better": better, "worse": worse}
        if shaken and better and not worse:
            winners.append(row)
    if winners:
        min(winners, key=objective)["best"] = True
    return error


# -- --shake spread ---------------------------------------------------------------


_NOT_SPREAD = frozenset({"label", "kind", "quantiles", "beyond_noise", "error", "ties"})


def spread(samples: list[Figures]) -> dict[str, Any]:
    """For every numeric figure, its min, max and mean over `samples`."""

    def walk(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: walk([v[k] for v in values]) for k in first if k not in _NOT_SPREAD}
        nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if not nums:
            return None
        return {"min": min(nums), "max": max(nums), "mean": round(sum(nums) / len(nums), 3)}

    return dict(walk(samples))


# -- output formats ---------------------------------------------------------------


def duration(seconds: float | None) -> str:
    """Compact human duration: 8.2s, 4m05s, 2h04m."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.1f}s"
    if round(s) < 3600:  # 59m59.6s reads 1h00m, not 60m00s
        m, sec = divmod(round(s), 60)
        return f"{m}m{sec:02d}s"
    h, m = divmod(round(s / 60), 60)
    return f"{h}h{m:02d}m"


def _cell(
    value: Any,
    spread_of: Any,
    fmt: Callable[[Any], str],
    error: float | None = None,
    tie: float | None = None,
) -> str:
    """`value`, with its error (`point_error`) as +/- when it has one, else its
    min-max over the shaken runs when they differ; a percentile on a tie says so:
    `0.0s (tie: 51% <= 0.0s)`."""
    text = fmt(value)
    if error is not None and value is not None:
        text += f" ±{fmt(error)}"
    elif isinstance(spread_of, dict) and "min" in spread_of:
        lo, hi = spread_of["min"], spread_of["max"]
        if lo != hi:
            text += f" ({fmt(lo)}-{fmt(hi)})"
    if tie is not None:
        text += f" (tie: {tie:.0%} <= {fmt(value)})"
    return text


def table(
    rows: list[Figures],
    header: str = "",
    *,
    error: dict[str, dict[str, float]] | None = None,
    by: Sequence[str] = (),
    guessed: bool = True,
) -> str:
    """The side-by-side report; `by` adds per-"caller" and per-"model" sections;
    `guessed`: its chains were guessed from timing (the log names none)."""
    out = io.StringIO()
    if header:
        out.write(header + "\n\n")
    name_w = max([len(r["label"]) + 2 for r in rows] + [10])
    out.write(
        "wait = arrival to dispatch, or to leaving; left = clients that gave up waiting or "
        "reached their deadline; fair = Jain's index of per-caller mean slowdown (1 = even)\n"
    )
    cols = ("count", "left", "p50", "p95", "p99", "max", "slowdown", "fair")
    band_rows: list[list[str]] = []
    for r in rows:
        sp = r.get("spread", {}).get("bands", {})
        name = _name(r)
        first = len(band_rows)
        for band in BANDS:
            b = r["bands"][band]
            if b["count"] == 0:
                continue
            bs = sp.get(band, {})
            be = r.get("error", {}).get("bands", {}).get(band, {})
            band_rows.append(
                [
                    name,
                    band,
                    str(b["count"]),
                    _cell(b["left"], bs.get("left"), _count, be.get("left")),
                    *(
                        _cell(b[k], bs.get(k), duration, be.get(k), b.get("ties", {}).get(k))
                        for k in ("wait_p50_s", "wait_p95_s", "wait_p99_s", "wait_max_s")
                    ),
                    _cell(b["slowdown"], bs.get("slowdown"), _ratio),
                    _cell(b["fairness"], bs.get("fairness"), _ratio, be.get("fairness")),
                ]
            )
            name = ""
        if len(band_rows) > first:
            band_rows.append([""] * (2 + len(cols)))  # a blank line between runs
    if band_rows:
        _grid(out, ["run", "band", *cols], band_rows[:-1], name_w)
    else:
        out.write("no requests\n")
    out.write("\n")
    overall = []
    for r in rows:
        sp = r.get("spread", {})
        ro = r["reorders"]
        worst = _worst(r)
        ch = r["chains"]
        overall.append(
            [
                _name(r),
                _cell(r["swaps"], sp.get("swaps"), str),
                _cell(r["swap_s"], sp.get("swap_s"), duration),
                _cell(r["idle_s"], sp.get("idle_s"), duration),
                _cell(r.get("busy_share"), sp.get("busy_share"), _share),
                _cell(r["makespan_s"], sp.get("makespan_s"), duration),
                "/".join(str(ro.get(k, 0)) for k in REORDER_REASONS),
                worst,
                "-"
                if not ch["count"]
                else _cell(
                    ch["completion_max_s"], sp.get("chains", {}).get("completion_max_s"), duration
                ),
            ]
        )
    _grid(
        out,
        [
            "run",
            "swaps",
            "swapping",
            "idle",
            "busy",
            "makespan",
            "reorders age/aff/fair/short",
            "worst wait",
            "longest chain (guessed)" if guessed else "longest chain",
        ],
        overall,
        name_w,
    )
    if guessed and any(r["chains"]["count"] for r in rows):
        out.write(
            "chains are guessed from timing (no event names a request's predecessor): a "
            "caller's request sent within --chain-gap of its previous one's end, with "
            "nothing else of its open, three requests at least\n"
        )
    for section in by:
        out.write("\n")
        _by_table(out, rows, section, name_w)
    if error:
        out.write(
            "\nsimulation error (the recorded parameters simulated vs the recorded run): "
            + "; ".join(
                f"{band} p95 {duration(e['wait_p95_s'])}, max {duration(e['wait_max_s'])}, "
                f"left {e['left']:g}, fair {e['fairness']:.2f}"
                for band, e in error.items()
            )
            + "\n"
        )
    shaken = any("spread" in r for r in rows)
    if any("error" in r for r in rows):
        out.write(
            "\n±: each simulated figure's error: the simulation error of that figure plus "
            "the farthest of its shaken runs from the printed value (each shaken run draws "
            "again what the replay estimated: the patience of served clients, every swap's "
            "time, the run time of requests that never ran; and moves arrivals and run "
            "times by --noise)\n"
        )
    if any(r["best"] for r in rows):
        out.write(
            "\n* best: beats the recorded parameters' simulation on some band's p95 wait, "
            "worst wait, left or fairness by more than both its error and the baseline's "
            "(±), is worse beyond them on none, and has the lowest interactive p95 "
            "wait, then worst batch wait, then slowdown (means over the shaken runs)\n"
        )
    elif error and any(r["kind"] == "simulated" for r in rows):
        out.write(
            "\nno * : no parameter set beats the recorded parameters by more than its "
            "error and the baseline's"
            + ("" if shaken else " (the error needs --shake N; without it nothing is marked)")
            + "\n"
        )
    return out.getvalue()


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _worst(row: Figures) -> str:
    """The worst wait, its band, and that band's worst wait over the shaken runs
    (its error, or its min-max): the band and the range are of the same figure. The
    worst of a shaken run may be in another band; `spread.worst_wait_s` (JSON) is
    that, over every band."""
    band = row["worst_wait_band"]
    if not band:
        return duration(row["worst_wait_s"])
    sp = row.get("spread", {}).get("bands", {}).get(band, {}).get("wait_max_s")
    error = row.get("error", {}).get("bands", {}).get(band, {}).get("wait_max_s")
    return f"{band} {_cell(row['worst_wait_s'], sp, duration, error)}"


def _name(row: Figures) -> str:
    return ("* " if row["best"] else "  ") + str(row["label"])


def _by_table(out: io.StringIO, rows: list[Figures], section: str, name_w: int) -> None:
    """One line per run and caller (or model)."""
    key = {"caller": "callers", "model": "models"}[section]
    head = ["run", section, "count", "left", "p50", "p95", "max"]
    if section == "caller":
        head += ["first start", "last finish"]
    lines: list[list[str]] = []
    for r in rows:
        sp = r.get("spread", {}).get(key, {})
        name = _name(r)
        for group, f in r[key].items():
            gs = sp.get(group, {})
            line = [
                name,
                group,
                str(f["count"]),
                _cell(f["left"], gs.get("left"), str),
                *(
                    _cell(f[k], gs.get(k), duration, tie=f.get("ties", {}).get(k))
                    for k in ("wait_p50_s", "wait_p95_s", "wait_max_s")
                ),
            ]
            if section == "caller":
                line += [
                    _cell(f[k], gs.get(k), duration) for k in ("first_start_s", "last_finish_s")
                ]
            lines.append(line)
            name = ""
        lines.append([""] * len(head))
    _grid(out, head, lines[:-1], name_w)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _grid(out: io.StringIO, head: list[str], rows: list[list[str]], name_w: int) -> None:
    widths = [
        max(len(head[c]), *(len(r[c]) for r in rows)) if rows else len(head[c])
        for c in range(len(head))
    ]
    widths[0] = max(widths[0], name_w)
    out.write(_line(head, widths) + "\n")
    for r in rows:
        out.write(_line(r, widths) + "\n")


def _line(cells: Iterable[str], widths: list[int]) -> str:
    parts = []
    for c, (text, w) in enumerate(zip(cells, widths, strict=True)):
        parts.append(text.ljust(w) if c < 2 else text.rjust(w))
    return "  ".join(parts).rstrip()


def to_json(rows: list[Figures], meta: dict[str, Any]) -> str:
    return json.dumps({**meta, "runs": rows}, indent=2)


def to_csv(rows: list[Figures]) -> str:
    """One line per run; nested figures flattened as band_figure, reorders_reason."""
    flat = [_flatten(r) for r in rows]
    keys: list[str] = []
    for f in flat:
        keys.extend(k for k in f if k not in keys)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return out.getvalue()


def _flatten(row: Figures, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if k == "bands":
            for band, figs in v.items():
                flat.update(_flatten(figs, f"{prefix}{band}_"))
        elif isinstance(v, dict):
            flat.update(_flatten(v, f"{key}_"))
        elif isinstance(v, list):
            flat[key] = ";".join(map(str, v))
        else:
            flat[key] = v
    return flat
