"""The replay checked against ground truth: `gpulane replay truth SCENARIO ...`.

The scenario generator knows every client's true patience and run time and runs them
through the real core, so the log it writes at some settings is what a server with
those settings would have done. For each seed this check generates the log at the
defaults (what a user would have recorded), replays it at each grid point as
`gpulane replay DB --fair-share-bonus N --short-job-bonus N` does (extraction, the
patience model, the simulation, the report's figures), generates the ground truth at
that point, and compares the two per band and per model: wait p50 / p95 / max and
clients who gave up. An error is predicted - true. With `references`, the reference
policies the replay prints beside its grid (`simulate.reference_policies`: arrival
order, priority without aging, the fifo scheduler) are checked too: the generator
runs the scenario through the real core under each of them.

The point the replay marks `*` (what `gpulane replay DB --sweep GRID --shake N`
recommends) is marked in each seed's comparisons (`Comparison.recommended`), so its
prediction and its truth can be read together.

The figures on both sides come from `report.figures` (the replay's simulated row, and
the truth log's recorded row), so the comparison measures the prediction, not a
difference in how statistics are computed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass

from app.core.scoring import ScoringParams
from tools.replay import report
from tools.replay.generate import SCENARIOS, generate_events
from tools.replay.patience import PatienceModel, with_patience
from tools.replay.report import BANDS, Figures
from tools.replay.resources import Resources
from tools.replay.simulate import Policy, reference_policies
from tools.replay.sweep import Shake, label_of, run_policies
from tools.replay.workload import DEFAULT_CHAIN_GAP_NS, Workload, extract_events

COMPARED = ("wait_p50_s", "wait_p95_s", "wait_max_s", "left")
"""The figures compared, per band and per model."""
DEFAULT_SHAKE = 10
"""Shaken runs per point, as `--shake 10` (docs/replay.md's sweeps)."""
_NAMES = {"wait_p50_s": "p50", "wait_p95_s": "p95", "wait_max_s": "max", "left": "left"}


@dataclass(frozen=True)
class Comparison:
    """One seed at one grid point: the replay's prediction and what really happens."""

    scenario: str
    seed: int
    params: ScoringParams
    predicted: Figures
    """The replay of the defaults log at `params` (a simulated row), or under a
    reference policy (a reference row)."""
    true: Figures
    """The log generated at `params`, or under the reference policy (its recorded
    row)."""
    label: str = ""
    """The point's name: `label_of(params)`, or the reference policy's label."""
    reference: bool = False
    """A reference policy (arrival order, priority without aging, fifo), not a point
    of the grid."""

    @property
    def point(self) -> str:
        return self.label or label_of(self.params)

    @property
    def recommended(self) -> bool:
        """The replay marked this point `*` among its seed's grid."""
        return bool(self.predicted.get("best"))

    def groups(self) -> list[tuple[str, dict[str, float | None], dict[str, float | None]]]:
        """(group, predicted figures, true figures): the bands with requests, then
        the models ("model NAME")."""
        out = []
        for band in BANDS:
            if self.true["bands"][band]["count"]:
                out.append((band, self.predicted["bands"][band], self.true["bands"][band]))
        for model, figs in self.true["models"].items():
            out.append((f"model {model}", self.predicted["models"][model], figs))
        return out

    def errors(self) -> dict[str, dict[str, float | None]]:
        """Per group and figure: predicted - true (None where either has no value)."""
        return {
            group: {k: _minus(p.get(k), t.get(k)) for k in COMPARED}
            for group, p, t in self.groups()
        }

    def printed_errors(self) -> dict[str, dict[str, float | None]]:
        """Per group and figure: the error the replay prints for its prediction
        (`report.point_error`; None without shaken runs)."""
        errs = self.predicted.get("error", {})
        out: dict[str, dict[str, float | None]] = {}
        for group, _p, _t in self.groups():
            name = group.removeprefix("model ")
            figs = errs.get("models" if name != group else "bands", {}).get(name, {})
            out[group] = {k: figs.get(k) for k in COMPARED}
        return out

    def within(self) -> dict[str, dict[str, bool | None]]:
        """Per group and figure: whether the true value lies within predicted +/- the
        printed error (None where a value or the error is missing)."""
        printed = self.printed_errors()
        return {
            group: {k: _inside(e, printed[group][k]) for k, e in errs.items()}
            for group, errs in self.errors().items()
        }


def _inside(error: float | None, printed: float | None) -> bool | None:
    return None if error is None or printed is None else abs(error) <= printed


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _log(
    scenario: str, seed: int, params: ScoringParams, days: int, policy: Policy | None = None
) -> Workload:
    """The workload and recorded run of the log `generate` writes at `params` (or under
    `policy`)."""
    built = SCENARIOS[scenario](seed, days=days)  # fresh: its swap costs are drawn
    priority = {r.request_id: r.priority for r in built.workload.requests}
    events = generate_events(built, params, label=f"{scenario}-seed{seed}", policy=policy)
    logged = extract_events(enumerate(events, 1), DEFAULT_CHAIN_GAP_NS)
    if policy is not None and policy.ignore_priority:
        # Arrival order enqueues every request at priority 0; its figures are per
        # band of the priority the client asked for, as the replay's reference row's.
        for r in logged.requests:
            r.priority = priority[r.request_id]
    return logged


def check(
    scenario: str,
    seeds: Sequence[int],
    grid: Sequence[ScoringParams],
    *,
    recorded: ScoringParams | None = None,
    patience: PatienceModel | None = None,
    days: int = 1,
    jobs: int | None = 1,
    shake: int = DEFAULT_SHAKE,
    noise: float = 0.05,
    references: bool = False,
    fifo_concurrency: int = 10,
    resources: Sequence[Resources] = (),
) -> list[Comparison]:
    """For each seed, the log generated at `recorded` (default: the defaults)
    replayed at each of `grid` with `shake` shaken runs (as `--shake` does: each
    prediction gets its printed error), against the log generated at that point;
    then each point on each of `resources` (a `--config`'s router and slots: the
    replay's `... on OTHER.yaml` rows, against the log generated with them); with
    `references`, also under each reference policy (last)."""
    recorded = recorded or ScoringParams()
    patience = patience or PatienceModel()
    out = []
    for seed in seeds:
        logged = with_patience(_log(scenario, seed, recorded, days), patience)
        assert logged.recorded is not None
        weights = tuple(sorted(logged.caller_weights.items()))
        # As the replay command builds its parameter sets (tools.replay.cli._policies):
        # the recorded parameters are the baseline the error is measured on.
        points = list(grid) if recorded in grid else [recorded, *grid]
        policies = [Policy(label_of(p), p, caller_weights=weights) for p in points]
        # As `gpulane replay DB --config OTHER.yaml` adds its rows: every point again
        # on the other resources.
        elsewhere = [
            Policy(
                f"{label_of(p)} on {what.label}",
                p,
                caller_weights=weights,
                router=what.router,
                slots=what.slots,
            )
            for what in resources
            for p in grid
        ]
        refs = reference_policies(logged, recorded, fifo_concurrency) if references else []
        rows = run_policies(
            logged,
            policies + elsewhere + refs,
            jobs=jobs,
            shake=Shake(shake, noise, 0, patience),
        )
        first = report.figures(
            logged,
            logged.recorded,
            label="recorded",
            kind="recorded",
            params=recorded,
            scheduler=logged.scheduler,
        )
        report.judge([first, *rows], label_of(recorded))
        by_params = dict(zip(points, rows[: len(points)], strict=True))
        for params in grid:
            predicted = by_params[params]
            true = _true(_log(scenario, seed, params, days), label_of(params), params)
            out.append(Comparison(scenario, seed, params, predicted, true, label_of(params)))
        rest = rows[len(points) :]
        for policy, predicted in zip(elsewhere, rest[: len(elsewhere)], strict=True):
            true = _true(
                _log(scenario, seed, policy.params, days, policy), policy.label, policy.params
            )
            out.append(Comparison(scenario, seed, policy.params, predicted, true, policy.label))
        for policy, predicted in zip(refs, rest[len(elsewhere) :], strict=True):
            true = _true(
                _log(scenario, seed, policy.params, days, policy), policy.label, policy.params
            )
            out.append(
                Comparison(
                    scenario, seed, policy.params, predicted, true, policy.label, reference=True
                )
            )
    return out


def _true(truth: Workload, label: str, params: ScoringParams) -> Figures:
    """The figures of a generated log's recorded run."""
    assert truth.recorded is not None
    return report.figures(
        truth,
        truth.recorded,
        label=label,
        kind="recorded",
        params=params,
        scheduler=truth.scheduler,
    )


def worst(comparisons: Sequence[Comparison]) -> dict[str, dict[str, float]]:
    """Per group and figure, the largest |error| over all seeds and grid points."""
    out: dict[str, dict[str, float]] = {}
    for c in comparisons:
        for group, errs in c.errors().items():
            into = out.setdefault(group, {})
            for k, e in errs.items():
                if e is not None:
                    into[k] = max(into.get(k, 0.0), abs(e))
    return out


def coverage(comparisons: Sequence[Comparison]) -> dict[str, dict[str, tuple[int, int]]]:
    """Per group and figure: (points whose true value lies within predicted +/- the
    printed error, points with an error) over every seed and grid point."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for c in comparisons:
        for group, figs in c.within().items():
            into = out.setdefault(group, {})
            for k, ok in figs.items():
                if ok is not None:
                    hit, total = into.get(k, (0, 0))
                    into[k] = (hit + ok, total + 1)
    return out


def table(comparisons: Sequence[Comparison], recorded: ScoringParams | None = None) -> str:
    """Predicted vs true, with the error and the printed error, per seed, grid point
    and group; then the worst error of each group and figure, and how often the truth
    lay within the printed error."""
    recorded = recorded or ScoringParams()
    lines = [
        f"the log generated at {label_of(recorded)}, replayed at each point (predicted) "
        "vs the log generated at that point (true); each cell: predicted ±printed error / "
        "true (predicted - true), marked ! where the truth lies outside the printed error"
    ]
    for c in comparisons:
        mark = (
            " (reference)"
            if c.reference
            else " (*: the replay recommends it)"
            if c.recommended
            else ""
        )
        lines.append(f"\n{c.scenario} seed {c.seed}, {c.point}{mark}")
        rows = [["group", *(_NAMES[k] for k in COMPARED)]]
        errors, printed, within = c.errors(), c.printed_errors(), c.within()
        for group, p, t in c.groups():
            rows.append(
                [
                    group,
                    *(
                        _cell(p[k], t[k], errors[group][k], printed[group][k], within[group][k], k)
                        for k in COMPARED
                    ),
                ]
            )
        lines.extend(_aligned(rows))
    points = [c for c in comparisons if not c.reference]
    refs = [c for c in comparisons if c.reference]
    for title, plural, part in (
        ("point", "points", points),
        ("reference policy", "reference policies", refs),
    ):
        if not part:
            continue
        lines.append(f"\nworst |predicted - true| over every seed and {title}")
        rows = [["group", *(_NAMES[k] for k in COMPARED)]]
        for group, errs in worst(part).items():
            rows.append([group, *(_fmt(errs.get(k), k) for k in COMPARED)])
        lines.extend(_aligned(rows))
        cover = coverage(part)
        if any(cover.values()):
            lines.append(f"\ntrue value within predicted ± printed error, {plural} of all")
            rows = [["group", *(_NAMES[k] for k in COMPARED)]]
            for group, figs in cover.items():
                rows.append(
                    [
                        group,
                        *(f"{figs[k][0]} of {figs[k][1]}" if k in figs else "-" for k in COMPARED),
                    ]
                )
            lines.extend(_aligned(rows))
    if lines_of_summary := summary(comparisons):
        lines.append("")
        lines.extend(lines_of_summary)
    return "\n".join(lines) + "\n"


def summary(
    comparisons: Sequence[Comparison], band: str = "interactive", key: str = "wait_p95_s"
) -> list[str]:
    """One line per point (and reference policy), one column per seed: `band`'s `key`
    as predicted ±printed error / true, `*` on the point the replay recommends; then,
    per seed, the point with the lowest true value and the recommended point's."""
    seeds = sorted({c.seed for c in comparisons})
    points = list(dict.fromkeys(c.point for c in comparisons))
    at = {(c.point, c.seed): c for c in comparisons}
    if not any(c.true["bands"][band].get(key) is not None for c in comparisons):
        return []
    rows = [[f"{band} {_NAMES[key]}", *(f"seed {s}" for s in seeds)]]
    for point in points:
        cells = []
        for seed in seeds:
            c = at.get((point, seed))
            p = c.predicted["bands"][band] if c else {}
            t = c.true["bands"][band] if c else {}
            if c is None or t.get(key) is None:
                cells.append("-")
                continue
            printed = c.printed_errors().get(band, {}).get(key)
            told = "" if printed is None else f" ±{_fmt(printed, key)}"
            mark = "* " if c.recommended else ""
            cells.append(f"{mark}{_fmt(p.get(key), key)}{told} / {_fmt(t[key], key)}")
        rows.append([point, *cells])
    lines = [f"{band} {_NAMES[key]}, predicted ±printed error / true (* the replay's pick)"]
    lines.extend(_aligned(rows))
    for seed in seeds:
        mine = [c for c in comparisons if c.seed == seed and not c.reference]
        valued = [c for c in mine if c.true["bands"][band].get(key) is not None]
        if not valued:
            continue
        best = min(valued, key=lambda c: c.true["bands"][band][key])
        text = (
            f"seed {seed}: lowest true {band} {_NAMES[key]} over the points "
            f"{_fmt(best.true['bands'][band][key], key)} at {best.point}"
        )
        pick = next((c for c in mine if c.recommended), None)
        if pick is not None:
            text += f"; the replay's pick {pick.point}: {_fmt(pick.true['bands'][band][key], key)}"
        lines.append(text)
    return lines


def _fmt(value: float | None, key: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    if key == "left":
        return f"{value:+g}" if signed else f"{value:g}"
    text = report.duration(abs(value))
    return ("-" if value < 0 else "+") + text if signed else text


def _cell(
    p: float | None,
    t: float | None,
    e: float | None,
    printed: float | None,
    within: bool | None,
    key: str,
) -> str:
    told = "" if printed is None else f" ±{_fmt(printed, key)}"
    mark = "!" if within is False else ""
    return f"{_fmt(p, key)}{told} / {_fmt(t, key)} ({_fmt(e, key, signed=True)}){mark}"


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def to_json(comparisons: Sequence[Comparison]) -> str:
    return json.dumps(
        {
            "comparisons": [
                {
                    "scenario": c.scenario,
                    "seed": c.seed,
                    "point": c.point,
                    "reference": c.reference,
                    "recommended": c.recommended,
                    "groups": {
                        group: {
                            k: {
                                "predicted": p[k],
                                "true": t[k],
                                "error": c.errors()[group][k],
                                "printed_error": c.printed_errors()[group][k],
                                "within": c.within()[group][k],
                            }
                            for k in COMPARED
                        }
                        for group, p, t in c.groups()
                    },
                }
                for c in comparisons
            ],
            "worst": worst(comparisons),
            "within": {
                group: {k: {"within": hit, "points": n} for k, (hit, n) in figs.items()}
                for group, figs in coverage(comparisons).items()
            },
        },
        indent=2,
    )


def build_truth_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{prog} truth",
        description="Check the replay against ground truth: generate a scenario's log at the "
        "defaults, replay it at each grid point, generate the log at that point, and compare "
        "wait p50 / p95 / max and clients who gave up, per band and per model.",
    )
    p.add_argument("scenario", choices=sorted(SCENARIOS), help="generated workload")
    p.add_argument("--seeds", default="1,2,3", metavar="N,...", help="seeds (default 1,2,3)")
    p.add_argument(
        "--grid",
        nargs="+",
        default=["fair=0,20", "short=0,20"],
        metavar="AXIS=V,...",
        help="points as --sweep takes them (default fair=0,20 short=0,20)",
    )
    p.add_argument(
        "--patience", default="auto", metavar="MODEL", help="the replay's --patience (auto)"
    )
    p.add_argument("--days", type=int, default=1, help="working days per log (default 1)")
    p.add_argument(
        "--shake",
        type=int,
        default=DEFAULT_SHAKE,
        metavar="N",
        help=f"the replay's --shake: shaken runs per point for its error ({DEFAULT_SHAKE})",
    )
    p.add_argument(
        "--noise", type=float, default=0.05, metavar="F", help="the replay's --noise (0.05)"
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="leave out the reference policies (arrival order, priority without aging, fifo)",
    )
    p.add_argument(
        "--fifo-concurrency",
        type=int,
        default=10,
        metavar="N",
        help="requests in flight per model in the fifo reference (default 10)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="OTHER.yaml",
        help="what-if resources, as the replay's --config: also each point on this config's "
        "router and slots, predicted and generated; repeatable",
    )
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    return p
