"""How long each client waits in the queue of a what-if run before it gives up.

A policy that makes clients wait longer loses some of them; a replay in which every
served client would have waited forever cannot show that. The model, per request:

- **it left in the recorded run** (its client cancelled, or it was abandoned, while
  queued): it leaves at its recorded patience (`Request.patience_ns`, from the log);
- **it has a deadline** (`max_wait_ns`, `X-Gpulane-Max-Wait`): the server cancels it
  then (reason `deadline`); the deadline is its patience;
- **a durable job** (`Prefer: respond-async`): nobody waits on a connection, it never
  leaves;
- **any other request** (served in the recorded run): its band's patience, but never
  less than it waited for its dispatch in the recorded run (its client was still there
  then). That patience is, by default (`auto`), the median patience of the recorded
  leavers of its band and model (an image's client waits longer than a chat's), else of
  its band (no leavers in the band: it never leaves), or stated per band
  (`--patience interactive=10m,normal=30m,batch=none`); `--patience none` keeps every
  served client waiting forever.

The floor is what keeps the recorded parameters honest: re-run with them, a served
client waits about as long as it did and stays. The median of the leavers is a low
estimate (the leavers are the impatient ones), so `auto` errs towards clients who
leave: a policy that delays work is penalised rather than flattered.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation

from app.core.priority import band_of
from app.core.scoring import NS_PER_S
from tools.replay.report import BANDS
from tools.replay.workload import Workload

_UNITS = {"s": 1, "m": 60, "h": 3600}


class PatienceError(ValueError):
    """A --patience argument that cannot be read; the message says which and why."""


@dataclass(frozen=True)
class PatienceModel:
    """`auto`: each band from its recorded leavers; `stated`: per band (None: stays)."""

    auto: bool = True
    stated: dict[str, int | None] = field(default_factory=dict)
    """Per band, the patience in ns (None: never leaves); a band absent here is auto."""

    def describe(self, bands: dict[str, int | None]) -> str:
        parts = [f"{b}={_text(bands.get(b))}" for b in BANDS]
        how = "from recorded leavers" if self.auto and not self.stated else "stated"
        if not self.auto:
            return "none (served clients never leave)"
        return ", ".join(parts) + f" ({how}; never less than the recorded wait)"


NONE = PatienceModel(auto=False)


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


def band_patience(workload: Workload, model: PatienceModel) -> dict[str, int | None]:
    """Each band's patience under `model` (None: never leaves)."""
    return {b: p for (b, m), p in patience_table(workload, model).items() if m is None}


def patience_table(
    workload: Workload, model: PatienceModel
) -> dict[tuple[str, str | None], int | None]:
    """(band, model) -> patience, and (band, None) -> the band's, under `model`. A
    stated band has one patience for all its models; otherwise a model with recorded
    leavers in the band gets their median (an image's client waits longer than a
    chat's), one without gets the band's."""
    leavers: dict[tuple[str, str | None], list[int]] = {}
    for r in workload.requests:
        # Clients who gave up; a deadline or a shutdown is not a client's patience.
        if r.patience_ns is not None and r.left_by in ("client_gone", "abandoned"):
            of = band_of(r.priority)
            leavers.setdefault((of, r.model), []).append(r.patience_ns)
            leavers.setdefault((of, None), []).append(r.patience_ns)
    out: dict[tuple[str, str | None], int | None] = {}
    for band in BANDS:
        if band in model.stated:
            out[(band, None)] = model.stated[band]
            continue
        samples = leavers.get((band, None))
        out[(band, None)] = int(statistics.median_low(samples)) if samples else None
        for (b, m), xs in leavers.items():
            if b == band and m is not None:
                out[(b, m)] = int(statistics.median_low(xs))
    return out


def with_patience(workload: Workload, model: PatienceModel) -> Workload:
    """A copy whose every request carries its patience under `model` (the recorded
    leavers keep theirs); the workload itself is not changed."""
    if not model.auto:
        return workload
    table = patience_table(workload, model)
    requests = []
    for r in workload.requests:
        if r.patience_ns is None and r.max_wait_ns is None and not r.durable:
            band = band_of(r.priority)
            patience = table.get((band, r.model), table[(band, None)])
            if patience is not None:
                # Still there when dispatched: a tie must not make it leave first.
                floor = -1 if r.waited_ns is None else r.waited_ns
                r = replace(r, patience_ns=max(patience, floor + 1))
        requests.append(r)
    return replace(workload, requests=requests)


def _text(ns: int | None) -> str:
    if ns is None:
        return "stays"
    s = ns / NS_PER_S
    if s >= 3600 and s % 3600 == 0:
        return f"{s / 3600:g}h"
    if s >= 60 and s % 60 == 0:
        return f"{s / 60:g}m"
    return f"{s:g}s"
