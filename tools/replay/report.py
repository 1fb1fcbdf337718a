"""Figures of a run, and the table / JSON / CSV that compare runs side by side.

Wait is from arrival to the moment the request starts on a loaded model (its queue
wait plus the swap it caused, if any). Per band: count, clients that left while
waiting, wait p50/p95/p99/max (nearest rank) and mean bounded slowdown
(wait + run) / max(run, 10 s) over the requests that ran. Overall: swaps, time spent
swapping, GPU idle time (nothing loading or running between the first arrival and the
last end), makespan, reorders by reason, and the worst wait against the starvation
bound aging guarantees: (priority span + bonus) x agingDivisor plus one run and one
swap (the span is 200 for the plain bands).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from app.core.priority import band_of
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.workload import RunResult, Workload

BANDS = ("interactive", "normal", "batch")
SLOWDOWN_FLOOR_NS = 10 * NS_PER_S
Figures = dict[str, Any]


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
    arrival = result.arrival_ns
    waits: dict[str, list[int]] = {}
    slow: dict[str, float] = {}
    left: dict[str, int] = {}
    count: dict[str, int] = {}
    worst = -1
    worst_band = ""
    for band, (members, runs) in _band_members(workload).items():
        served = [
            (start[i] - arrival[i], run)
            for i, run in zip(members, runs, strict=True)
            if start[i] >= 0
        ]
        count[band] = len(members)
        left[band] = len(members) - len(served)
        waits[band] = [w for w, _ in served]
        slow[band] = sum((w + run) / max(run, SLOWDOWN_FLOOR_NS) for w, run in served)
        top = max(waits[band], default=-1)
        if top > worst:
            worst, worst_band = top, band
    bands: dict[str, Any] = {}
    curves: dict[str, list[float | None]] = {}
    for band in BANDS:
        ws = sorted(waits[band])
        if quantiles and ws:
            curves[band] = [_s(ws[0]), *(_s(_pct(ws, p)) for p in range(1, 101))]
        bands[band] = {
            "count": count[band],
            "left": left[band],
            "wait_p50_s": _s(_pct(ws, 50)),
            "wait_p95_s": _s(_pct(ws, 95)),
            "wait_p99_s": _s(_pct(ws, 99)),
            "wait_max_s": _s(ws[-1] if ws else None),
            "slowdown": round(slow[band] / len(ws), 3) if ws else None,
        }
    makespan = max(0, result.last_ns - result.first_ns)
    bound = (
        starvation_bound_ns(workload, params)
        if params is not None and kind != "reference"
        else None
    )
    row: Figures = {
        "label": label,
        "kind": kind,
        "scheduler": scheduler,
        "aging_divisor_s": None if params is None else params.aging_divisor_ns / NS_PER_S,
        "swap_affinity_bonus": None if params is None else params.swap_affinity_bonus,
        "bands": bands,
        "swaps": result.swaps,
        "swap_s": _s(result.swap_ns),
        "idle_s": _s(max(0, makespan - result.busy_ns)),
        "makespan_s": _s(makespan),
        "reorders": dict(result.reorders),
        "worst_wait_s": _s(worst if worst >= 0 else None),
        "worst_wait_band": worst_band or None,
        "bound_s": _s(bound),
        "within_bound": None if bound is None or worst < 0 else worst <= bound,
        "best": False,
    }
    if quantiles:
        row["quantiles"] = curves
    return row


_MEMBERS: list[tuple[Workload, dict[str, tuple[list[int], list[int]]]]] = []


def _band_members(workload: Workload) -> dict[str, tuple[list[int], list[int]]]:
    """Per band: request indices and their run times (kept for the last workload seen,
    since a sweep computes figures of many runs of one workload)."""
    if _MEMBERS and _MEMBERS[0][0] is workload:
        return _MEMBERS[0][1]
    groups: dict[str, tuple[list[int], list[int]]] = {b: ([], []) for b in BANDS}
    for i, r in enumerate(workload.requests):
        members, runs = groups[band_of(r.priority)]
        members.append(i)
        runs.append(r.run_ns)
    _MEMBERS[:] = [(workload, groups)]
    return groups


def starvation_bound_ns(workload: Workload, params: ScoringParams) -> int | None:
    """(priority span + bonus) x agingDivisor + the longest run + the longest swap; None
    without aging (no bound)."""
    if params.aging_divisor_ns == 0 or not workload.requests:
        return None
    priorities = [r.priority for r in workload.requests]
    span = max(priorities) - min(priorities)
    st = workload.swap_times
    longest_swap = max(st.unload_ns.values(), default=st.default_unload_ns) + max(
        st.load_ns.values(), default=st.default_load_ns
    )
    longest_run = max(r.run_ns for r in workload.requests)
    return (
        (span + params.swap_affinity_bonus) * params.aging_divisor_ns + longest_run + longest_swap
    )


def _pct(sorted_values: Sequence[int], p: float) -> int | None:
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / NS_PER_S, 3)


# -- choosing the best candidate ------------------------------------------------


def objective(row: Figures) -> tuple[float, float, float]:
    """Lower is better: interactive p95 wait, then worst batch wait, then mean slowdown.
    With --shake, each is its mean over the trace and its perturbed copies."""
    bands = row["bands"]
    means = row.get("spread", {}).get("bands", {})

    def value(band: str, key: str) -> float:
        mean = (means.get(band, {}).get(key) or {}).get("mean")
        v = mean if mean is not None else bands[band][key]
        return float(v) if v is not None else 0.0

    served = {b: f["count"] - f["left"] for b, f in bands.items()}
    total = sum(served.values()) or 1
    slow = sum(value(b, "slowdown") * n for b, n in served.items()) / total
    return (value("interactive", "wait_p95_s"), value("batch", "wait_max_s"), slow)


def mark_best(rows: list[Figures]) -> Figures | None:
    """Flag the best parameter set: lowest objective among simulated runs that have a
    starvation bound and stay within it (any simulated run if none does)."""
    sims = [r for r in rows if r["kind"] == "simulated"]
    safe = [r for r in sims if r["within_bound"]]
    pool = safe or sims
    if not pool:
        return None
    best = min(pool, key=objective)
    best["best"] = True
    return best


# -- --shake spread ---------------------------------------------------------------


def spread(samples: list[Figures]) -> dict[str, Any]:
    """For every numeric figure, its min, max and mean over `samples`."""

    def walk(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: walk([v[k] for v in values]) for k in first if k not in ("label", "kind")}
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
    if s < 3600:
        m, sec = divmod(round(s), 60)
        return f"{m}m{sec:02d}s"
    h, m = divmod(round(s / 60), 60)
    return f"{h}h{m:02d}m"


def _cell(value: Any, spread_of: Any, fmt: Callable[[Any], str]) -> str:
    text = fmt(value)
    if isinstance(spread_of, dict) and "min" in spread_of:
        lo, hi = spread_of["min"], spread_of["max"]
        if lo != hi:
            text += f" ({fmt(lo)}-{fmt(hi)})"
    return text


def table(rows: list[Figures], header: str = "") -> str:
    out = io.StringIO()
    if header:
        out.write(header + "\n\n")
    name_w = max([len(r["label"]) + 2 for r in rows] + [10])
    out.write("wait = arrival to start on a loaded model; left = clients that gave up waiting\n")
    cols = ("count", "left", "p50", "p95", "p99", "max", "slowdown")
    band_rows: list[list[str]] = []
    for r in rows:
        sp = r.get("spread", {}).get("bands", {})
        name = ("* " if r["best"] else "  ") + r["label"]
        first = len(band_rows)
        for band in BANDS:
            b = r["bands"][band]
            if b["count"] == 0:
                continue
            bs = sp.get(band, {})
            band_rows.append(
                [
                    name,
                    band,
                    str(b["count"]),
                    str(b["left"]),
                    *(
                        _cell(b[k], bs.get(k), duration)
                        for k in ("wait_p50_s", "wait_p95_s", "wait_p99_s", "wait_max_s")
                    ),
                    _cell(b["slowdown"], bs.get("slowdown"), _ratio),
                ]
            )
            name = ""
        if len(band_rows) > first:
            band_rows.append([""] * 9)  # a blank line between runs
    if band_rows:
        _grid(out, ["run", "band", *cols], band_rows[:-1], name_w)
    else:
        out.write("no requests\n")
    out.write("\n")
    overall = []
    for r in rows:
        sp = r.get("spread", {})
        ro = r["reorders"]
        worst = _cell(r["worst_wait_s"], sp.get("worst_wait_s"), duration)
        if r["worst_wait_band"]:
            worst += f" ({r['worst_wait_band']})"
        if r["bound_s"] is None:
            bound = "none"
        else:
            bound = duration(r["bound_s"]) + ("" if r["within_bound"] else " EXCEEDED")
        overall.append(
            [
                ("* " if r["best"] else "  ") + r["label"],
                _cell(r["swaps"], sp.get("swaps"), str),
                _cell(r["swap_s"], sp.get("swap_s"), duration),
                _cell(r["idle_s"], sp.get("idle_s"), duration),
                _cell(r["makespan_s"], sp.get("makespan_s"), duration),
                f"{ro.get('aging', 0)}/{ro.get('swap_affinity', 0)}",
                worst,
                bound,
            ]
        )
    _grid(
        out,
        ["run", "swaps", "swapping", "idle", "makespan", "reorders age/aff", "worst wait", "bound"],
        overall,
        name_w,
    )
    if any(r["best"] for r in rows):
        out.write(
            "\n* best: lowest interactive p95 wait, then worst batch wait, then slowdown"
            " (means over the shaken runs, if any), among parameter sets within their"
            " starvation bound\n"
        )
    return out.getvalue()


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
        else:
            flat[key] = v
    return flat
