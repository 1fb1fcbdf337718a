"""What each what-if resource changed, in one line per run: the swaps it avoided
and the lane's busy share, beside the same parameters on the recorded resources
(`--config`, `--memory-budget`)."""

from __future__ import annotations

from tools.replay.report import Figures

_PARAMS = ("aging_divisor_s", "swap_affinity_bonus", "fair_share_bonus", "short_job_bonus")


def resource_lines(rows: list[Figures], resource_labels: list[str]) -> str:
    """One line per run on a what-if resource (its label ends `on <resource>`)."""
    lines: list[str] = []
    for row in rows:
        what = next((w for w in resource_labels if row["label"].endswith(f" on {w}")), None)
        if what is None or row["kind"] != "simulated":
            continue
        base = next(
            (
                r
                for r in rows
                if r["kind"] == "simulated"
                and not any(r["label"].endswith(f" on {w}") for w in resource_labels)
                and all(r[k] == row[k] for k in _PARAMS)
            ),
            None,
        )
        if base is None:
            continue
        avoided = base["swaps"] - row["swaps"]
        lines.append(
            f"{row['label']}: {row['swaps']} swaps, {avoided} avoided beside "
            f"{base['label']} ({base['swaps']}); lane busy {_pct(row['busy_share'])} beside "
            f"{_pct(base['busy_share'])}"
        )
    return "".join(f"{line}\n" for line in lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"
