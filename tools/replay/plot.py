"""`--plot FILE.png`: wait distributions per band for each run, and the GPU timeline of
the recorded run above the best candidate's. Needs matplotlib (`pip install
'gpulane[plot]'`); everything else in replay works without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.core.scoring import NS_PER_S
from tools.replay.report import BANDS, Figures

TIMELINE_WINDOW_NS = 24 * 3600 * NS_PER_S
"""The timelines show the first day of the trace (a long trace is unreadable whole)."""

Span = tuple[int, int, str, str]


class PlotUnavailable(RuntimeError):
    pass


def plot(
    path: str | Path,
    rows: list[Figures],
    timelines: list[tuple[str, list[Span]]],
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'gpulane[plot]' (or matplotlib)"
        ) from exc
    bands = [b for b in BANDS if any(r.get("quantiles", {}).get(b) for r in rows)]
    n_top = max(1, len(bands))
    fig = plt.figure(figsize=(14, 4 + 3 * n_top + 1.6 * len(timelines)))
    grid = fig.add_gridspec(
        n_top + len(timelines), 1, height_ratios=[3] * n_top + [1.6] * len(timelines)
    )
    percentiles = list(range(101))
    for k, band in enumerate(bands):
        ax = fig.add_subplot(grid[k, 0])
        for r in rows:
            curve = r.get("quantiles", {}).get(band)
            if not curve:
                continue
            minutes = [None if v is None else v / 60 for v in curve]
            style: dict[str, Any] = (
                {"linewidth": 2.5} if r["best"] or r["kind"] == "recorded" else {}
            )
            ax.plot(minutes, percentiles, label=("* " if r["best"] else "") + r["label"], **style)
        ax.set_title(f"{band}: wait (arrival to dispatch, or to leaving), cumulative")
        ax.set_xlabel("minutes")
        ax.set_ylabel("percentile")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="lower right")
    for j, (title, spans) in enumerate(timelines):
        ax = fig.add_subplot(grid[n_top + j, 0])
        _timeline(ax, title, spans)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(ax: Any, title: str, spans: list[Span]) -> None:
    if not spans:
        ax.set_title(f"{title}: nothing ran")
        return
    t0 = min(s[0] for s in spans)
    end = t0 + TIMELINE_WINDOW_NS
    models = sorted({s[2] for s in spans})
    row = {m: i for i, m in enumerate(models)}
    colors = {"run": "tab:blue", "swap": "tab:red"}
    for kind in ("run", "swap"):
        for m in models:
            bars = [
                ((a - t0) / 3600e9, (min(b, end) - a) / 3600e9)
                for a, b, model, k in spans
                if model == m and k == kind and a < end
            ]
            if bars:
                ax.broken_barh(bars, (row[m] - 0.4, 0.8), facecolors=colors[kind])
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel("hours (blue: running, red: swapping)")
    ax.set_title(f"GPU timeline, {title}")
