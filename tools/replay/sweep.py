"""Grids of parameter sets, run in parallel on the machine's cores.

Workers are forked after the workload is loaded, so it is shared copy-on-write and
never pickled; each task is one (policy, shake index) and returns its figures only.
`--shake N` runs every policy again on N perturbed copies of the workload (the same
N copies for every policy, so they are compared on equal terms).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from multiprocessing.context import BaseContext

from app.core.priority import BAND_STEP, DEFAULT_TIER_SPAN, band_lift_error
from app.core.scoring import NS_PER_S, ScoringParams
from tools.replay.patience import PatienceModel, with_patience
from tools.replay.report import Figures, figures, spread
from tools.replay.simulate import Policy, shaken, simulate
from tools.replay.workload import Workload

AXES = {
    "aging": "aging divisor (seconds)",
    "bonus": "swap affinity bonus (points)",
    "fair": "fair-share bonus (points)",
    "short": "short-job bonus (points)",
}
MAX_BOUNDED_POINTS = BAND_STEP - 1
"""One bounded term's most points (together they must stay below a band, `checked`)."""


class GridError(ValueError):
    """A --sweep argument that cannot be read; the message says which and why."""


def seconds_to_ns(text: str) -> int:
    """'60', '0.004', '1.5' seconds -> exact integer ns (no float rounding)."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise GridError(f"{text!r} is not a number of seconds") from None
    if not value.is_finite() or value < 0:
        raise GridError(f"{text!r}: the aging divisor must be a number of seconds >= 0")
    return int(value * NS_PER_S)


def parse_bonus(text: str, name: str = "bonus") -> int:
    try:
        bonus = int(text)
    except ValueError:
        raise GridError(f"{text!r} is not an integer {name}") from None
    if not 0 <= bonus <= MAX_BOUNDED_POINTS:
        raise GridError(
            f"{name} {bonus}: must be 0..{MAX_BOUNDED_POINTS} (it must never cross a band)"
        )
    return bonus


def checked(params: ScoringParams, tier_span: int = DEFAULT_TIER_SPAN) -> ScoringParams:
    """`params`, refused as the config refuses it when its bounded terms with tier
    offsets up to `tier_span` (the config's default) could lift a request into the
    next band (aging is the only term allowed to cross)."""
    error = band_lift_error(
        {
            "swapAffinityBonus": params.swap_affinity_bonus,
            "fairShareBonus": params.fair_share_bonus,
            "shortJobBonus": params.short_job_bonus,
        },
        tier_span,
    )
    if error is not None:
        raise GridError(f"{label_of(params)}: {error}")
    return params


def parse_grid(
    specs: list[str], base: ScoringParams, tier_span: int = DEFAULT_TIER_SPAN
) -> list[ScoringParams]:
    """`aging=0,30,60 bonus=0,10 fair=0,20 short=0,10` -> every combination; a missing
    axis keeps `base`'s value."""
    axes: dict[str, list[int]] = {
        "aging": [base.aging_divisor_ns],
        "bonus": [base.swap_affinity_bonus],
        "fair": [base.fair_share_bonus],
        "short": [base.short_job_bonus],
    }
    seen = set()
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise GridError(f"{spec!r}: expected AXIS=V1,V2,... with AXIS one of {', '.join(AXES)}")
        if name in seen:
            raise GridError(f"{name} is given twice")
        seen.add(name)
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not items:
            raise GridError(f"{spec!r}: no values")
        if name == "aging":
            axes[name] = list(dict.fromkeys(seconds_to_ns(v) for v in items))
        else:
            axes[name] = list(dict.fromkeys(parse_bonus(v, name) for v in items))
    return [
        checked(ScoringParams(a, b, f, s), tier_span)
        for a, b, f, s in itertools.product(
            axes["aging"], axes["bonus"], axes["fair"], axes["short"]
        )
    ]


def label_of(params: ScoringParams) -> str:
    """`aging=60s bonus=10`, with `fair=N short=N` when those terms are on."""
    text = f"aging={_secs(params.aging_divisor_ns)} bonus={params.swap_affinity_bonus}"
    if params.fair_share_bonus:
        text += f" fair={params.fair_share_bonus}"
    if params.short_job_bonus:
        text += f" short={params.short_job_bonus}"
    return text


def _secs(ns: int) -> str:
    value = Decimal(ns) / NS_PER_S
    text = format(value.normalize(), "f")
    return text + "s"


@dataclass(frozen=True)
class Shake:
    """`--shake`: N more runs of every policy on copies of the workload that redraw
    what the replay estimated (`simulate.shaken`: run times of requests that never
    ran; `SwapTimes.sampler`: each swap's time from the measured ones; the served
    clients' patience with another seed, when `patience` is given) and jitter what it
    measured by `noise` (run times, arrivals)."""

    runs: int = 0
    noise: float = 0.05
    seed: int = 0
    patience: PatienceModel | None = None
    """The patience model the workload was given (`with_patience`): each copy draws
    its served clients' patience again with its own seed. None: kept."""

    def copy_seed(self, index: int) -> int:
        return self.seed * 1_000_003 + index


# -- running ------------------------------------------------------------------------

_WORKLOAD: Workload | None = None
_SHAKEN: dict[int, Workload] = {}


def _init(workload: Workload | None) -> None:
    global _WORKLOAD
    if workload is not None:  # spawn: shipped once per worker; fork: inherited
        _WORKLOAD = workload
    _SHAKEN.clear()


def _task(args: tuple[Policy, int, Shake, bool]) -> Figures:
    policy, shake_index, shake, quantiles = args
    base = _WORKLOAD
    assert base is not None
    if shake_index < 0:
        workload = base
        result = simulate(workload, policy)
    else:
        seed = shake.copy_seed(shake_index)
        cached = _SHAKEN.get(shake_index)
        if cached is None:
            cached = shaken(base, seed, shake.noise)
            if shake.patience is not None:
                cached = with_patience(cached, shake.patience, seed=1 + seed)
            _SHAKEN.clear()
            _SHAKEN[shake_index] = cached
        workload = cached
        result = simulate(workload, policy, swap_cost=workload.swap_times.sampler(seed))
    return figures(
        workload,
        result,
        label=policy.label,
        kind=policy.kind,
        params=policy.params,
        scheduler=policy.scheduler,
        quantiles=quantiles,
    )


def run_policies(
    workload: Workload,
    policies: list[Policy],
    *,
    jobs: int | None = None,
    shake: Shake | None = None,
    quantiles: bool = False,
) -> list[Figures]:
    """Figures for each policy, in order. With shake, each also carries `spread`: the
    min and max of every figure over the trace itself and its N perturbed copies."""
    global _WORKLOAD
    shake = shake or Shake()
    tasks = [(p, -1, shake, quantiles) for p in policies]
    tasks += [(p, s, shake, False) for s in range(shake.runs) for p in policies]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    if jobs == 1:
        _init(workload)
        results = [_task(t) for t in tasks]
    else:
        ctx: BaseContext
        if "fork" in multiprocessing.get_all_start_methods():
            _WORKLOAD = workload  # inherited by the forked workers, never pickled
            ctx = multiprocessing.get_context("fork")
            initargs: tuple[Workload | None] = (None,)
        else:
            ctx = multiprocessing.get_context("spawn")
            initargs = (workload,)
        with ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_init, initargs=initargs
        ) as pool:
            results = list(pool.map(_task, tasks, chunksize=1))
    rows = results[: len(policies)]
    for i, row in enumerate(rows):
        samples = [results[len(policies) * (1 + s) + i] for s in range(shake.runs)]
        if samples:
            row["spread"] = spread([row, *samples])
            row["shake"] = {"runs": shake.runs, "noise": shake.noise, "seed": shake.seed}
    return rows
