"""The console's queue page as data: one window of `live_queue.queue_view`, each row
with its score terms and a reason it waits. Pure: the caller passes the view.

Score terms are read off the `Breakdown` struct's fields (every field but
`total`), so a term the core gains becomes a column with no change here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from app.core.scoring import Breakdown
from app.report.live_queue import QueueView, WaitingEntry
from app.report.visibility import waits_for_seen_by


def score_terms(view: QueueView) -> list[str]:
    """The score's term names, in the core's order."""
    fields = (
        view.waiting[0].score.__struct_fields__ if view.waiting else Breakdown.__struct_fields__
    )
    return [f for f in fields if f != "total"]


def reason(view: QueueView, entry: WaitingEntry, ahead: WaitingEntry | None) -> str:
    """Why `entry` is not running now, in words, from what the view shows."""
    next_model = view.loading or view.resident
    blocked = entry.waits_for
    if blocked is None:
        swap = entry.model != next_model
    else:  # with several models in use, what it waits for says whether it needs a load
        swap = blocked.kind == "load" or (blocked.kind == "drain" and blocked.model != entry.model)
    if ahead is None:
        if view.loading == entry.model:
            return f"next: its model {entry.model} is loading"
        if view.loading is not None:
            return f"next: waits for the swap to {view.loading}, then a swap to {entry.model}"
        if view.running:
            where = f", then a swap to {entry.model}" if swap else ""
            return f"next: waits for the running job{where}"
        return f"next: waiting for a swap to {entry.model}" if swap else "next: about to start"
    mine = msgspec.structs.asdict(entry.score)
    theirs = msgspec.structs.asdict(ahead.score)
    if theirs["total"] > mine["total"]:
        # The term that opens the biggest gap is the one to name.
        gaps = {k: theirs[k] - mine[k] for k in mine if k != "total"}
        term = max(gaps, key=lambda k: gaps[k])
        shown = _points(gaps[term])
        if shown.strip("0.") == "":
            # Only aging differs, by less than a hundredth: it simply came first.
            text = "behind an equal score that arrived earlier"
        else:
            text = f"behind a higher score ({term} +{shown})"
    elif theirs["total"] < mine["total"]:
        # The rows follow the simulated dispatch: by then the row above's model is
        # in use, and its affinity bonus puts it first.
        text = f"behind a lower score for {ahead.model}, in use by then (swap affinity)"
    else:
        text = "behind an equal score that arrived earlier"
    return text + (f"; needs a swap to {entry.model}" if swap else "")


def queue_page(
    view: QueueView, offset: int, limit: int, caller: str | None = None
) -> dict[str, Any]:
    """`limit` waiting rows from `offset` (0-based), and everything that runs; with
    `caller` (a user key), only its rows, keeping the whole queue's positions and
    each row's reason against the request truly ahead of it."""
    # `view` may list a window of the queue (see `page_window`): waiting[0] is at
    # 0-based position `base`, and the row before a page is there for its reason.
    base = view.waiting[0].position - 1 if view.waiting else 0
    if caller is None:
        indexes = list(range(max(0, offset - base), min(len(view.waiting), offset - base + limit)))
        total = max(view.total_waiting, len(view.waiting))
        by_model = dict(view.waiting_by_model) or _by_model(view, range(len(view.waiting)))
    else:
        mine = [i for i, w in enumerate(view.waiting) if w.caller == caller]
        indexes = mine[offset : offset + limit]
        total = len(mine)
        by_model = _by_model(view, mine)
    rows = []
    for index in indexes:
        entry = view.waiting[index]
        # The row just ahead in the whole queue: a caller's view (`queue_view(caller=)`)
        # lists it beside each of its rows for exactly this.
        ahead = view.waiting[index - 1] if index > 0 else None
        rows.append(
            {
                "position": entry.position,
                "request_id": entry.request_id,
                "model": entry.model,
                "caller": entry.caller,
                "band": entry.band,
                "priority": entry.priority,
                "waited_s": entry.waited_s,
                "estimated_start_at": entry.estimated_start_at,
                "estimated_start_in_s": entry.estimated_start_in_s,
                "estimated_start_open": entry.estimated_start_open,
                "score": msgspec.structs.asdict(entry.score),
                "reason": reason(view, entry, ahead),
                "waits_for": _waits_for(entry, caller),
            }
        )
    running = []
    for run in view.running:
        if caller is not None and run.caller != caller:
            continue
        running.append(msgspec.structs.asdict(run))  # its expected end: the estimator's
    return {
        "live": True,
        "as_of": view.as_of,
        "scheduler": view.scheduler,
        "resident": view.resident,
        "loading": view.loading,
        "terms": score_terms(view),
        "total_waiting": total,
        "waiting_by_model": by_model,
        "offset": offset,
        "limit": limit,
        "running": running,
        "waiting": rows,
    }


def page_window(offset: int, limit: int) -> tuple[int, int]:
    """(first, count) of the view one page needs: its rows and the row before."""
    first = max(0, offset - 1)
    return first, limit + offset - first


def _waits_for(entry: WaitingEntry, caller: str | None) -> dict[str, Any] | None:
    """What the row waits for (app/report/waits.py) as `caller` may see it, with
    its words (`text`)."""
    seen = waits_for_seen_by(entry.waits_for, caller)
    return None if seen is None else {**msgspec.structs.asdict(seen), "text": seen.text()}


def _by_model(view: QueueView, indexes: Iterable[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for index in indexes:
        model = view.waiting[index].model
        counts[model] = counts.get(model, 0) + 1
    return counts


def _points(value: float) -> str:
    return f"{value:g}" if isinstance(value, int) else f"{value:.2f}"
