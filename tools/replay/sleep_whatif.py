"""What if a model slept instead of stopping (`replay DB --what-if sleep=MODEL,...`).

The workload of the log is run twice on the same core with the recorded
parameters: as recorded ("today": every swap costs the stop of what it evicts
and the cold load of its model, the log's medians) and with the named models
sleeping: evicting one costs its sleep, loading one that sleeps costs its wake
(a first load, or one after it never slept, is still a cold start). The costs
are the log's (`app.core.swap_costs`: the median of each model's recent sleeps
and wakes, when the log has any) or given (`--costs MODEL=sleep:0.5,wake:1`;
a given one wins). Printed side by side: the interactive requests' waits
(to dispatch, and to start: their own swap included), the swaps and their
time, the lane's busy share (the time it ran requests over the span from the
first arrival to the last end) and the makespan.

The host-memory budget for sleepers (`sleepHostMemory`) is not simulated: every
named model sleeps whenever it is evicted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from app.core import events as ev
from app.core.priority import band_of
from app.core.swap_costs import ACTIONS, ActionCosts, swap_costs
from tools.replay.simulate import Policy, SwapCost, reference_policies, simulate
from tools.replay.workload import RunResult, Workload

_KINDS = ACTIONS


class WhatIfError(Exception):
    """A `--what-if` or `--costs` that cannot be used, with a sentence saying why."""


def parse_what_if(text: str, models: Sequence[str]) -> list[str]:
    """`sleep=MODEL[,MODEL...]` -> the models that sleep (each one of the log's)."""
    kind, sep, names = text.partition("=")
    if kind.strip() != "sleep" or not sep:
        raise WhatIfError(f"--what-if {text!r}: expected sleep=MODEL[,MODEL...]")
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(models))
    if not chosen or unknown:
        raise WhatIfError(
            f"--what-if {text!r}: {', '.join(unknown) or 'no model'} is not one of the log's "
            f"models ({', '.join(models) or 'none'})"
        )
    return chosen


def parse_costs(items: Iterable[str]) -> dict[str, ActionCosts]:
    """`MODEL=sleep:0.5,wake:1,start:20,stop:2` (seconds), each item one model."""
    out: dict[str, ActionCosts] = {}
    for item in items:
        model, sep, rest = item.partition("=")
        if not sep or not model.strip():
            raise WhatIfError(f"--costs {item!r}: expected MODEL=sleep:S,wake:S[,start:S,stop:S]")
        given: dict[str, int] = {}
        for part in rest.split(","):
            kind, colon, value = part.partition(":")
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if kind.strip() not in _KINDS or not colon or not seconds >= 0:
                raise WhatIfError(
                    f"--costs {item!r}: {part!r} is not KIND:SECONDS with KIND one of "
                    f"{', '.join(_KINDS)} and SECONDS >= 0"
                )
            given[f"{kind.strip()}_ns"] = round(seconds * 1e9)
        out[model.strip()] = ActionCosts(**given)
    return out


def sleeping_cost(
    base: SwapCost, sleepers: Iterable[str], costs: Mapping[str, ActionCosts]
) -> SwapCost:
    """`base` with the `sleepers` put to sleep when evicted and woken when loaded.
    Stateful: one per run (it remembers who sleeps)."""
    sleeps = frozenset(sleepers)
    asleep: set[str] = set()

    def cost(from_model: str | None, to_model: str) -> tuple[int, int]:
        unload, load = base(from_model, to_model)
        known = costs.get(to_model, ActionCosts())
        if known.start_ns is not None:
            load = known.start_ns
        if from_model is not None:
            out = costs.get(from_model, ActionCosts())
            if from_model in sleeps and out.sleep_ns is not None:
                unload = out.sleep_ns
                asleep.add(from_model)
            elif out.stop_ns is not None:
                unload = out.stop_ns
        if to_model in asleep and known.wake_ns is not None:
            asleep.discard(to_model)
            load = known.wake_ns
        return unload, load

    return cost


@dataclass(frozen=True)
class Figures:
    label: str
    interactive: int
    wait_p50_s: float
    wait_p95_s: float
    wait_max_s: float
    start_p50_s: float
    start_max_s: float
    swaps: int
    swap_s: float
    busy_share: float
    makespan_s: float


def figures(label: str, workload: Workload, result: RunResult) -> Figures:
    """The figures of one run: interactive waits and starts, swaps, busy share."""
    waits: list[int] = []
    starts: list[int] = []
    ran = 0
    last = result.first_ns
    for i, request in enumerate(workload.requests):
        start, end = result.start_ns[i], result.end_ns[i]
        if start >= 0 and end >= 0:
            ran += end - start
            last = max(last, end)
        if band_of(request.priority) != "interactive" or start < 0:
            continue
        waits.append(result.wait_ns[i])
        starts.append(start - result.arrival_ns[i])
    span = max(1, last - result.first_ns)
    return Figures(
        label=label,
        interactive=len(waits),
        wait_p50_s=_q(waits, 0.5),
        wait_p95_s=_q(waits, 0.95),
        wait_max_s=_q(waits, 1.0),
        start_p50_s=_q(starts, 0.5),
        start_max_s=_q(starts, 1.0),
        swaps=result.swaps,
        swap_s=result.swap_ns / 1e9,
        busy_share=ran / span,
        makespan_s=span / 1e9,
    )


def _q(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] / 1e9


def compare(
    workload: Workload,
    sleepers: Sequence[str],
    costs: Mapping[str, ActionCosts],
    *,
    policy: Policy | None = None,
    arrival_order: bool = True,
) -> list[Figures]:
    """Today's run and the sleeping one under `policy` (default: the recorded
    parameters), and, with `arrival_order`, both in arrival order too."""
    base = workload.swap_times.cost
    policy = policy or Policy("recorded", workload.params, router=workload.router)
    runs = [(policy, "")]
    if arrival_order:
        runs.append((reference_policies(workload, workload.params, 1)[0], ""))
    out = []
    for p, _ in runs:
        today = simulate(workload, p, swap_cost=sleeping_cost(base, (), costs))
        out.append(figures(f"{p.label}, stop and cold start", workload, today))
        slept = simulate(workload, p, swap_cost=sleeping_cost(base, sleepers, costs))
        out.append(figures(f"{p.label}, {'+'.join(sleepers)} sleep", workload, slept))
    return out


def learnt_costs(
    events: Iterable[ev.AnyEvent], given: Mapping[str, ActionCosts]
) -> dict[str, ActionCosts]:
    """Each model's costs from the log's events, each given one replacing the learnt."""
    learnt = swap_costs(events).table()
    out = dict(learnt)
    for model, costs in given.items():
        had = learnt.get(model, ActionCosts())
        merged = {}
        for k in _KINDS:
            value = costs.of(k)
            merged[f"{k}_ns"] = value if value is not None else had.of(k)
        out[model] = ActionCosts(**merged)
    return out


def table(rows: Sequence[Figures], header: str) -> str:
    lines = [header, ""]
    head = (
        f"{'run':<52} {'inter':>5} {'wait p50':>9} {'p95':>7} {'max':>7} "
        f"{'start p50':>9} {'max':>7} {'swaps':>5} {'swap s':>7} {'busy':>6} {'makespan':>9}"
    )
    lines.append(head)
    for r in rows:
        lines.append(
            f"{r.label:<52} {r.interactive:>5} {r.wait_p50_s:>9.1f} {r.wait_p95_s:>7.1f} "
            f"{r.wait_max_s:>7.1f} {r.start_p50_s:>9.1f} {r.start_max_s:>7.1f} {r.swaps:>5} "
            f"{r.swap_s:>7.1f} {r.busy_share:>6.1%} {r.makespan_s:>8.0f}s"
        )
    return "\n".join(lines) + "\n"


def costs_lines(costs: Mapping[str, ActionCosts], models: Sequence[str]) -> str:
    out = ["swap costs (s; - unknown: the log's load and unload medians apply):"]
    for m in models:
        c = costs.get(m, ActionCosts())
        cells = [f"{k} {_s(c.of(k))}" for k in _KINDS]
        out.append(f"  {m}: " + ", ".join(cells))
    return "\n".join(out) + "\n"


def _s(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e9:.2f}"


def to_json(rows: Sequence[Figures], costs: Mapping[str, ActionCosts]) -> str:
    return json.dumps(
        {
            "runs": [r.__dict__ for r in rows],
            "costs_s": {
                m: {k: None if (v := c.of(k)) is None else v / 1e9 for k in _KINDS}
                for m, c in costs.items()
            },
        },
        indent=2,
    )
