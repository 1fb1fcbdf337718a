"""How long each client waits in the queue of a what-if run before it gives up.

A policy that makes clients wait longer loses some of them; a replay in which every
served client would have waited forever cannot show that. The model, per request:

- **it left in the recorded run** (its client cancelled, or it was abandoned, while
  queued): it leaves at its recorded patience (`Request.patience_ns`, from the log);
- **it has a deadline** (`max_wait_ns`, `X-Gpulane-Max-Wait`): the server cancels it
  then (reason `deadline`); the deadline is its patience;
- **a durable job** (`Prefer: respond-async`): nobody waits on a connection, it never
  leaves;
- **any other request** (served in the recorded run): by default (`auto`) a patience
  drawn from its band and model's survival curve, conditioned on its having waited at
  least what it waited for its dispatch in the recorded run (its client was still
  there then); or stated per band (`--patience interactive=10m,normal=30m,batch=none`,
  never less than the recorded wait); `--patience none` keeps every served client
  waiting forever.

The survival curve is a Kaplan-Meier estimate per band and model. Each client of the
band and model is one observation of its patience: a client who gave up (cancelled or
abandoned while queued) left at its time in the queue; every other client (served,
cancelled by a deadline or a shutdown) is right-censored there: it waited at least
that long. Durable jobs are no observation (nobody waits on them). The curve drops
only at leavers' times and never past the longest observation: a client whose draw
falls below the curve's end stays ("never leaves within what was observed"), and a
band and model with no leavers keeps all its clients. One model's leavers are never
lent to another's clients (an image's client waits longer than a chat's).

The draw is deterministic: each request's quantile is a hash of its id and a seed.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation

from app.core.priority import band_of
from app.core.scoring import NS_PER_S
from tools.replay.report import BANDS, duration
from tools.replay.workload import Request, Workload

_UNITS = {"s": 1, "m": 60, "h": 3600}
LEFT = frozenset({"client_gone", "abandoned"})
"""How a client gives up; a deadline or a shutdown is not a client's patience."""


class PatienceError(ValueError):
    """A --patience argument that cannot be read; the message says which and why."""


@dataclass(frozen=True)
class PatienceModel:
    """`auto`: Kaplan-Meier per band and model; `stated`: per band (None: stays)."""

    auto: bool = True
    stated: dict[str, int | None] = field(default_factory=dict)
    """Per band, the patience in ns (None: never leaves); a band absent here is auto."""


NONE = PatienceModel(auto=False)


@dataclass(frozen=True)
class Survival:
    """A Kaplan-Meier estimate of one group's patience: S(t) = P(patience > t)."""

    times: tuple[int, ...] = ()
    """The distinct times (ns) at which clients left, ascending."""
    survival: tuple[float, ...] = ()
    """S just after each of `times` (non-increasing)."""
    leavers: int = 0
    censored: int = 0
    """Clients who had not left when they stopped being observed (served, say)."""
    longest_ns: int = 0
    """The longest observation, left or not: the curve says nothing beyond it."""

    def at(self, t_ns: int) -> float:
        """S(t): the share of clients still waiting after `t_ns` in the queue."""
        k = bisect.bisect_right(self.times, t_ns)
        return self.survival[k - 1] if k else 1.0

    def quantile(self, u: float, waited_ns: int = -1) -> int | None:
        """The patience whose conditional survival, given it exceeds `waited_ns`, is
        `u`: the first leaving time t > waited_ns with S(t) <= u * S(waited_ns).
        None when the curve ends above that (stays within what was observed)."""
        target = u * self.at(waited_ns)
        for k in range(bisect.bisect_right(self.times, waited_ns), len(self.times)):
            if self.survival[k] <= target:
                return self.times[k]
        return None

    @property
    def median_ns(self) -> int | None:
        return self.quantile(0.5)


def kaplan_meier(observations: Iterable[tuple[int, bool]]) -> Survival:
    """The survival curve of `(time in the queue ns, left)` observations. At a time
    with both, the censored ones count as still at risk (they left no earlier)."""
    obs = sorted(observations)
    n = len(obs)
    times: list[int] = []
    survival: list[float] = []
    s = 1.0
    i = 0
    leavers = 0
    while i < n:
        t = obs[i][0]
        j = i
        left = 0
        while j < n and obs[j][0] == t:
            left += obs[j][1]
            j += 1
        if left:
            s *= 1.0 - left / (n - i)  # n - i clients were still waiting at t
            times.append(t)
            survival.append(s)
            leavers += left
        i = j
    return Survival(tuple(times), tuple(survival), leavers, n - leavers, obs[-1][0] if obs else 0)


Group = tuple[str, str]
"""(band, model)."""


def observations(workload: Workload) -> dict[Group, list[tuple[int, bool]]]:
    """Each band and model's observations of its clients' patience (time, left)."""
    out: dict[Group, list[tuple[int, bool]]] = {}
    for r in workload.requests:
        obs = _observation(r)
        if obs is not None:
            out.setdefault((band_of(r.priority), r.model), []).append(obs)
    return out


def _observation(r: Request) -> tuple[int, bool] | None:
    if r.durable:
        return None
    if r.waited_ns is not None:
        return (r.waited_ns, False)  # served: it waited at least that long
    if r.patience_ns is not None and not r.patience_drawn:
        return (r.patience_ns, r.left_by in LEFT)
    return None  # still queued at the log's end


def estimates(workload: Workload) -> dict[Group, Survival]:
    """Each band and model's Kaplan-Meier curve, in band then model order."""
    obs = observations(workload)
    return {g: kaplan_meier(obs[g]) for g in sorted(obs, key=lambda g: (BANDS.index(g[0]), g[1]))}


def parse_patience(text: str) -> PatienceModel:
    """'auto', 'none', or 'interactive=10m,normal=30m,batch=none' (missing bands: auto)."""
    text = text.strip()
    if text == "auto":
        return PatienceModel()
    if text == "none":
        return NONE
    stated: dict[str, int | None] = {}
    for item in text.split(","):
        band, sep, value = item.partition("=")
        band = band.strip()
        if not sep or band not in BANDS:
            raise PatienceError(
                f"--patience {item!r}: expected auto, none, or BAND=DURATION,... "
                f"with BAND one of {', '.join(BANDS)}"
            )
        if band in stated:
            raise PatienceError(f"--patience: {band} is given twice")
        stated[band] = None if value.strip() == "none" else parse_duration_ns(value)
    return PatienceModel(stated=stated)


def parse_duration_ns(text: str) -> int:
    """'90', '90s', '10m', '1.5h' -> ns."""
    text = text.strip()
    unit = _UNITS.get(text[-1:], 0)
    number = text[:-1] if unit else text
    try:
        value = Decimal(number) * (unit or 1)
    except InvalidOperation:
        raise PatienceError(f"{text!r} is not a duration (90s, 10m, 1.5h or none)") from None
    if not value.is_finite() or value <= 0:
        raise PatienceError(f"{text!r}: a patience must be a duration > 0 (or none)")
    return int(value * NS_PER_S)


def draw(request_id: str, seed: int = 0) -> float:
    """The request's quantile in (0, 1): the same for the same id and seed."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


def with_patience(workload: Workload, model: PatienceModel, seed: int = 0) -> Workload:
    """A copy whose every served request carries its patience under `model` (the
    recorded leavers keep theirs); the workload itself is not changed. A patience
    drawn before (`Request.patience_drawn`) is drawn again, with `seed`: a shaken copy
    (`--shake`) draws every served client's patience with another seed."""
    if not model.auto:
        return workload
    curves = estimates(workload)
    requests = []
    for r in workload.requests:
        if r.patience_drawn:
            r = replace(r, patience_ns=None, patience_drawn=False)
        if r.patience_ns is None and r.max_wait_ns is None and not r.durable:
            band = band_of(r.priority)
            waited = -1 if r.waited_ns is None else r.waited_ns
            if band in model.stated:
                stated = model.stated[band]
                # Still there when dispatched: a tie must not make it leave first.
                patience = None if stated is None else max(stated, waited + 1)
            else:
                curve = curves.get((band, r.model))
                patience = (
                    None if curve is None else curve.quantile(draw(r.request_id, seed), waited)
                )
            if patience is not None:
                r = replace(r, patience_ns=patience, patience_drawn=True)
        requests.append(r)
    return replace(workload, requests=requests)


def summary(workload: Workload, model: PatienceModel) -> list[dict[str, object]]:
    """Which estimate each band and model got, from how many leavers and censored
    observations (JSON-able; seconds)."""
    if not model.auto:
        return []
    out: list[dict[str, object]] = []
    for (band, name), curve in estimates(workload).items():
        row: dict[str, object] = {
            "band": band,
            "model": name,
            "leavers": curve.leavers,
            "censored": curve.censored,
            "longest_s": _s(curve.longest_ns),
        }
        if band in model.stated:
            row |= {"estimate": "stated", "patience_s": _s(model.stated[band])}
        elif curve.leavers:
            row |= {"estimate": "kaplan-meier", "median_s": _s(curve.median_ns)}
        else:
            row |= {"estimate": "stays"}
        out.append(row)
    return out


def describe(workload: Workload, model: PatienceModel) -> str:
    """The report's lines on the patience of served clients: the estimate each band
    and model got, from how many leavers and censored observations."""
    if not model.auto:
        return "none (served clients never leave)"
    lines = [
        "per band and model, never less than the recorded wait; Kaplan-Meier: each client "
        "draws from its group's survival curve (leavers, the others censored at their "
        "wait), conditioned on the wait it survived"
    ]
    for (band, name), curve in estimates(workload).items():
        longest = duration(curve.longest_ns / NS_PER_S)
        if band in model.stated:
            stated = model.stated[band]
            what = "stated " + ("stays" if stated is None else duration(stated / NS_PER_S))
        elif curve.leavers:
            median = curve.median_ns
            what = "Kaplan-Meier, median " + (
                f"beyond {longest}" if median is None else duration(median / NS_PER_S)
            )
        else:
            what = f"stays (no leavers: never leaves within the {longest} observed)"
        lines.append(
            f"  {band} {name}: {what} ({curve.leavers} leavers, {curve.censored} censored)"
        )
    return "\n".join(lines)


def _s(ns: int | None) -> float | None:
    return None if ns is None else round(ns / NS_PER_S, 3)
