"""What a user key may see of a report: its own requests, and other callers' work
only as "another caller's request", with no id and no label (issue 21).

Every function takes `viewer`, the caller a user key lists (`access.only_caller`):
None is an admin, who sees everything, and gets its input back unchanged. Pure:
the routes pass what they read. Aggregates stay (queue depth, positions in the
whole queue, a model's in-flight count): they name nobody.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from app.report.live_queue import QueueView, WaitingEntry
from app.report.story import (
    Ahead,
    Decision,
    Explanation,
    HeldFor,
    RunningAtArrival,
    SwapWaited,
)
from app.report.waits import WaitsFor

ANOTHER_CALLER = "another caller's request"
"""What stands for another caller's request id where its data is shown as it is
(a raw event)."""


def _theirs(viewer: str | None, caller: str | None) -> bool:
    return viewer is not None and caller != viewer


def story_seen_by(story: Explanation, viewer: str | None) -> Explanation:
    """`story` (the viewer's own request) with every other caller's request that
    held it back, won a decision over it or caused a swap it waited through,
    shown as `another_caller` with neither id nor caller."""
    if viewer is None:
        return story

    def running(r: RunningAtArrival) -> RunningAtArrival:
        if not _theirs(viewer, r.caller):
            return r
        return msgspec.structs.replace(r, request_id=None, caller=None, another_caller=True)

    def ahead(a: Ahead) -> Ahead:
        if not _theirs(viewer, a.caller):
            return a
        return msgspec.structs.replace(a, request_id=None, caller=None, another_caller=True)

    def decision(d: Decision) -> Decision:
        if not _theirs(viewer, d.winner_caller):
            return d
        return msgspec.structs.replace(
            d, winner_id=None, winner_caller=None, winner_another_caller=True
        )

    def held(h: HeldFor) -> HeldFor:
        if h.request_id is None or not _theirs(viewer, h.caller):
            return h
        return msgspec.structs.replace(h, request_id=None, caller=None, another_caller=True)

    def swap(s: SwapWaited) -> SwapWaited:
        if s.request_id is None or not _theirs(viewer, s.caller):
            return s  # a preload is nobody's
        return msgspec.structs.replace(s, request_id=None, caller=None, another_caller=True)

    return msgspec.structs.replace(
        story,
        running_at_arrival=[running(r) for r in story.running_at_arrival],
        ahead=[ahead(a) for a in story.ahead],
        decisions=[decision(d) for d in story.decisions],
        swaps=[swap(s) for s in story.swaps],
        held_for=[held(h) for h in story.held_for],
        # Its own model may have been loading for someone else when it was dispatched.
        own_swap=None if story.own_swap is None else swap(story.own_swap),
    )


def queue_seen_by(view: QueueView, viewer: str | None) -> QueueView:
    """Only the viewer's running and waiting rows, at their places in the whole
    queue (position 5: four requests go first, whoever sent them)."""
    if viewer is None:
        return view

    def waiting(w: WaitingEntry) -> WaitingEntry:
        seen = waits_for_seen_by(w.waits_for, viewer)
        return w if seen is w.waits_for else msgspec.structs.replace(w, waits_for=seen)

    return msgspec.structs.replace(
        view,
        running=[r for r in view.running if r.caller == viewer],
        waiting=[waiting(w) for w in view.waiting if w.caller == viewer],
    )


def waits_for_seen_by(blocked: WaitsFor | None, viewer: str | None) -> WaitsFor | None:
    """What a request waits for, as `viewer` may see it: a drain for another
    caller's request names no request and no caller."""
    if blocked is None or blocked.for_request is None or not _theirs(viewer, blocked.for_caller):
        return blocked
    return msgspec.structs.replace(blocked, for_request=None, for_caller=None, another_caller=True)


def swaps_seen_by(rows: Iterable[Mapping[str, Any]], viewer: str | None) -> list[dict[str, Any]]:
    """Swap rows (with the `caller` of the request that caused each): another
    caller's swap keeps its models and times, and loses its request id and caller."""
    out = []
    for row in rows:
        shown = dict(row)
        theirs = row.get("request_id") is not None and _theirs(viewer, row.get("caller"))
        if theirs:
            shown.update(request_id=None, caller=None)
        shown["another_caller"] = theirs
        out.append(shown)
    return out


def event_data_seen_by(data: Any, callers: Mapping[str, str | None], viewer: str | None) -> Any:
    """A raw event's data (decoded JSON) with every request id of another caller
    (`runner_up_id`, `without_aging_id`, ...: any value that `callers`, the callers
    of the requests it names, does not give to `viewer`) replaced by ANOTHER_CALLER."""
    if viewer is None:
        return data
    if isinstance(data, dict):
        return {k: event_data_seen_by(v, callers, viewer) for k, v in data.items()}
    if isinstance(data, list):
        return [event_data_seen_by(v, callers, viewer) for v in data]
    if isinstance(data, str) and data in callers and _theirs(viewer, callers[data]):
        return ANOTHER_CALLER
    return data


def request_ids_in(data: Any) -> set[str]:
    """Every string in a raw event's data under a key ending in `_id`: the request
    ids it may name, whose callers `event_data_seen_by` needs."""
    found: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            if key.endswith("_id") and isinstance(value, str):
                found.add(value)
            else:
                found |= request_ids_in(value)
    elif isinstance(data, list):
        for value in data:
            found |= request_ids_in(value)
    return found
