"""Plain-text renderings of an `Explanation` and a `QueueView`, for the CLI."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from app.core.scoring import Breakdown
from app.core.swap_costs import woke
from app.report.live_queue import QueueView
from app.report.progress import Progress
from app.report.story import Cause, Explanation, SwapWaited
from app.report.visibility import ANOTHER_CALLER

CAUSE_TEXT: dict[Cause, str] = {
    "running_at_arrival": "behind the job running when it arrived",
    "higher_band": "behind requests of a higher band",
    "higher_tier": "behind higher priorities in its band",
    "swap_affinity": "behind requests for the loaded model (affinity)",
    "fair_share": "behind callers who had less GPU time (fair share)",
    "short_job": "behind shorter expected work (short job)",
    "aging": "behind requests that aged past it",
    "arrived_earlier": "behind requests that arrived earlier",
    "swaps": "model swaps",
    "slot": "waited for a free slot",
    "drain": "waited while a model drained",
    "evicted": "its model evicted for another request",
    "load_backoff": "its model backing off after failed loads",
    "restart": "gpulane not running (restart)",
    "earlier_attempts": "earlier attempts of this job",
    "other": "between decisions",
}

OUT_OF_MEMORY = "its server ran out of GPU memory ({line})"
"""A load that failed so (`SwapWaited.out_of_memory`), as the request's error says it."""

HELD_TEXT: dict[Cause, str] = {
    "slot": "for a free slot of {model}",
    "drain": "while {model} drained for {request}",
    "evicted": "{model} evicted by {request}",
}
"""One line per `HeldFor` under its part: which model, and for whom."""

REASON_TEXT = {
    "higher_band": "higher band",
    "higher_tier": "higher priority in the same band",
    "swap_affinity": "its model was loaded (swap affinity)",
    "fair_share": "its caller had had less GPU time (fair share)",
    "short_job": "its expected run was shorter (short job)",
    "aging": "waited long enough to age past it",
    "arrived_earlier": "same score terms, arrived earlier",
}

SHOWN = 25
"""Decisions and requests ahead listed in full before eliding the middle."""


def clock(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def score(b: Breakdown) -> str:
    terms = f"{b.priority:+d} prio {b.affinity:+d} affinity"
    if b.fair_share:
        terms += f" +{b.fair_share:.2f} fair share"
    if b.short_job:
        terms += f" +{b.short_job:.2f} short job"
    return f"{b.total:.2f} ({terms} +{b.aging:.2f} aging)"


def seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f} s"


def _elide(lines: list[str], what: str) -> list[str]:
    if len(lines) <= SHOWN:
        return lines
    half = SHOWN // 2
    return [
        *lines[:half],
        f"    ... {len(lines) - 2 * half} more {what} (--json lists all)",
        *lines[-half:],
    ]


def named(request_id: str | None, width: int | None = None) -> str:
    """A request as a story names it: its id (the first `width` characters), or,
    for a user key's view of another caller's, no id (app/report/visibility.py)."""
    if request_id is None:
        return ANOTHER_CALLER
    return request_id[:width] if width else request_id


def granted_text(
    granted: int,
    requested: int | None,
    ignored: str | None = None,
    unreadable: str | None = None,
) -> str:
    """How the priority it queued at came about (`ignored`, the warning, stands
    in for `unreadable`, the header as sent, in logs before it)."""
    if unreadable is not None:
        return f"priority granted {granted}: asked '{unreadable}' (unreadable, used {granted})"
    if requested is None and ignored is not None:
        return f"priority granted {granted}, the caller's default: {ignored}"
    if requested is None:
        return f"priority granted {granted}: none requested, the caller's default"
    if requested > granted:
        return (
            f"priority granted {granted}: requested {requested}, "
            "lowered to the caller's maxPriority"
        )
    return f"priority granted {granted}: as requested"


def explanation_text(x: Explanation) -> str:
    out = [f"request {x.request_id}: {x.status}"]
    if x.model is None:
        # A refusal's row keeps no resolved model: its error says what was wrong.
        model = "no model" if x.model_requested is None else f"model {x.model_requested!r}"
    elif x.model == x.model_requested:
        model = x.model
    else:
        model = f"{x.model} (asked for {x.model_requested})"
    out.append(f"  {model} · {x.endpoint} · caller {x.caller or '-'}")
    out.append(
        f"  arrived {stamp(x.arrived_at)} · priority {x.priority} ({x.band}) · attempt {x.attempt}"
    )
    if x.chain is not None:
        out.append(f"  {x.chain.text()}")
    if x.status == "rejected":
        assert x.outcome is not None
        out.append(f"  rejected at admission: HTTP {x.outcome.http_status}: {x.outcome.error}")
        return "\n".join(out) + "\n"
    granted = granted_text(
        x.priority, x.requested_priority, x.priority_ignored, x.priority_unreadable
    )
    out.append(f"  {granted}")
    aging = f"1 point per {x.aging_divisor_s:g} s" if x.aging_divisor_s else "off"
    out.append(
        f"  scheduler {x.scheduler} · aging {aging} · swap affinity bonus {x.swap_affinity_bonus}"
    )
    out.append("")
    running = ", ".join(
        f"render {named(r.request_id)} on {r.model}, {r.held_s:.1f} s (held until it ended)"
        if r.render
        else f"{named(r.request_id)} ({r.model}, {r.band}) since {clock(r.since)}"
        for r in x.running_at_arrival
    )
    out.append(
        f"On arrival: resident {x.resident_at_arrival or 'none'}; "
        f"{x.queue_depth_at_arrival} waiting; running {running or 'nothing'}"
    )
    if x.decisions:
        out.append("")
        out.append("Decisions while it waited (its score, then the winner's):")
        lines = []
        for d in x.decisions:
            if d.reason is None:
                lines.append(f"  {clock(d.at)}  {score(d.score)}  -> it won")
            else:
                lines.append(
                    f"  {clock(d.at)}  {score(d.score)}  -> {named(d.winner_id, 8)} "
                    f"({d.winner_model}) "
                    f"{d.winner.total:.2f}: {d.reason.replace('_', ' ')}"
                )
        out += _elide(lines, "decisions")
    if x.ahead:
        out.append("")
        out.append("Dispatched ahead of it:")
        lines = [
            f"  {named(a.request_id)} {a.model} {a.band} ({a.priority:+d}) held the GPU "
            f"{seconds(a.held_s)}: {REASON_TEXT[a.reason]}"
            for a in x.ahead
        ]
        out += _elide(lines, "requests")
    if x.swaps:
        out.append("")
        out.append("Swaps it waited through:")
        for s in x.swaps:
            cause = "preload"
            if s.request_id or s.another_caller:
                cause = f"for {named(s.request_id)}"
            failed = f" FAILED: {s.error}" if s.error else ""
            if s.out_of_memory:
                failed = f" FAILED: {OUT_OF_MEMORY.format(line=s.out_of_memory)}"
            out.append(
                f"  {s.from_model or 'none'} -> {s.to_model} {cause}: {seconds(s.duration_s)} "
                f"({seconds(s.waited_s)} of its wait){memory(s)}{failed}{_sleep_note(s)}"
            )
    out.append("")
    if x.dispatched_at is not None:
        own = "no swap"
        if x.own_swap is not None:
            own = (
                f"swap {x.own_swap.from_model or 'none'} -> {x.own_swap.to_model} "
                f"{seconds(x.own_swap.duration_s)}{memory(x.own_swap)}{_sleep_note(x.own_swap)}"
            )
        out.append(
            f"Its turn: dispatched {clock(x.dispatched_at)}, {own}, "
            f"started {clock(x.started_at)} (time to start {seconds(x.time_to_start_s)}), "
            f"ran {seconds(x.run_s)}"
        )
        if x.own_swap is not None and x.own_swap.out_of_memory:
            line = OUT_OF_MEMORY.format(line=x.own_swap.out_of_memory)
            out.append(f"  Its load of {x.own_swap.to_model} failed: {line}")
    if x.waiting is not None:
        w = x.waiting
        out.append(
            f"Still waiting as of {clock(x.as_of)}: position {w.position} of {w.queue_depth}, "
            + (
                f"starts after {clock(w.estimated_start_at)} (at least "
                f"{w.estimated_start_in_s:.1f} s: behind a run longer than any run of its "
                "model, its end unknown)"
                if w.estimated_start_open
                else f"estimated start {clock(w.estimated_start_at)} "
                f"(in {w.estimated_start_in_s:.1f} s)"
            )
        )
    if x.outcome is not None:
        o = x.outcome
        detail = ", ".join(
            f"{k} {v}"
            for k, v in (("HTTP", o.http_status), ("error", o.error), ("reason", o.cancel_reason))
            if v is not None
        )
        out.append(f"Ended: {o.status} at {clock(o.at)}" + (f" ({detail})" if detail else ""))
    out.append("")
    out.append(f"Wait {x.wait_s:.3f} s:")
    for part in x.wait:
        text = CAUSE_TEXT[part.cause]
        if part.cause == "load_backoff":
            n = x.failed_loads
            text = f"while model {x.model} backed off after {n} failed load{'s' * (n != 1)}"
        out.append(f"  {text:<50} {part.seconds:9.3f} s {part.percent:6.1f} %")
        for held in x.held_for if part.cause in HELD_TEXT else ():
            if held.cause == part.cause:
                who = named(held.request_id) if held.request_id or held.another_caller else "?"
                line = HELD_TEXT[held.cause].format(model=held.model, request=who)
                out.append(f"    {line:<48} {held.seconds:9.3f} s")
    out.append(f"Total {x.total_s:.3f} s from arrival to {'end' if x.outcome else 'now'}.")
    if not x.replay_matches:
        out.append("WARNING: replaying the log did not reproduce every recorded decision.")
    return "\n".join(out) + "\n"


def queue_text(q: QueueView) -> str:
    aging = f"1 point per {q.aging_divisor_s:g} s" if q.aging_divisor_s else "aging off"
    bonuses = f"bonus {q.swap_affinity_bonus}"
    if q.fair_share_bonus:
        bonuses += f", fair share {q.fair_share_bonus}"
    if q.short_job_bonus:
        bonuses += f", short job {q.short_job_bonus}"
    out = [
        f"as of {stamp(q.as_of)} · scheduler {q.scheduler} ({aging}, {bonuses})",
        f"resident {q.resident or 'none'}" + (f" · loading {q.loading}" if q.loading else ""),
    ]
    if not q.running:
        out.append("running: nothing")
    for r in q.running:
        since = f"since {clock(r.since)} ({r.for_s:.1f} s)" if r.for_s is not None else ""
        loading = " (loading its model)" if r.loading else ""
        who = f" caller {r.caller}" if r.caller else ""
        if r.expected_end_open:
            end = ", end unknown: longer than any run of its model"
        else:
            end = "" if r.expected_end_at is None else f", expected end {clock(r.expected_end_at)}"
        if r.progress is not None:
            end += f" ({r.progress[0]}/{r.progress[1]} done)"
        out.append(
            f"running: {r.request_id} {r.model} {r.band} ({r.priority:+d}){who} {since}"
            f"{loading}{end}"
        )
    if not q.waiting:
        out.append("waiting: nobody")
        return "\n".join(out) + "\n"
    # One column per term of the score, as Slurm's sprio lays out its factors.
    out.append(
        f"{'#':>3}  {'request':<32}  {'model':<12} {'band':<11} {'prio':>5} "
        f"{'affin':>5} {'fair':>6} {'short':>6} {'aging':>8} "
        f"{'score':>9} {'waited':>9} {'starts in':>10}  caller"
    )
    for w in q.waiting:
        b = w.score
        out.append(
            f"{w.position:>3}  {w.request_id:<32}  {w.model:<12} {w.band:<11} {b.priority:>5} "
            f"{b.affinity:>5} {b.fair_share:>6.2f} {b.short_job:>6.2f} {b.aging:>8.2f} "
            f"{b.total:>9.2f} {w.waited_s:>8.1f}s "
            f"{'>=' if w.estimated_start_open else '':>2}{w.estimated_start_in_s:>7.1f}s"
            f"  {w.caller or '-'}" + (f"  waits for {w.waits_for.text()}" if w.waits_for else "")
        )
    if any(w.estimated_start_open for w in q.waiting):
        out.append(
            ">= : at the earliest, behind a run longer than any run of its model (its end unknown)"
        )
    if q.total_waiting > len(q.waiting):
        out.append(f"({q.total_waiting} waiting in all; this page lists {len(q.waiting)})")
    return "\n".join(out) + "\n"


def progress_text(p: Progress) -> str:
    """One line: `40/174 done, 1 running, 133 waiting, 0 failed; ends ~2025-01-06
    14:32:10.000 UTC (in 9h03m, 80% in 8h10m to 9h50m): median run wan-video
    4m02s, 3 ahead, 120 overtaking, 1 load` (the interval and the overtaking work
    when the estimate forecast it)."""
    head = f"{p.done}/{p.total} done, {p.running} running, {p.waiting} waiting, {p.failed} failed"
    if p.estimated_finish_at is None or p.estimated_finish_in_s is None or p.basis is None:
        return head
    b = p.basis
    runs = ", ".join(f"{m} {duration(s)}" for m, s in b.run_s.items())
    loads = f"{b.swaps} load" + ("" if b.swaps == 1 else "s")
    ahead = f"{b.ahead} ahead"
    if p.estimated_finish_low_in_s is not None:  # the forecast of overtaking work
        high = p.estimated_finish_high_in_s
        interval = (
            f", 80% in {duration(p.estimated_finish_low_in_s)} to "
            f"{'?' if high is None else duration(high)}"
        )
        ahead += f", {b.overtaking} overtaking" + (
            "" if b.earlier_days else " (no earlier day: from today's rate so far)"
        )
    else:
        interval = ""
    if p.estimated_finish_open:
        # Behind a run longer than any of its model: the least it can be.
        return (
            f"{head}; ends after {stamp(p.estimated_finish_at)} at the earliest "
            f"(at least {duration(p.estimated_finish_in_s)}{interval}; a run has gone "
            f"longer than any run of its model, its end unknown): median run {runs}, "
            f"{ahead}, {loads}"
        )
    return (
        f"{head}; ends ~{stamp(p.estimated_finish_at)} "
        f"(in {duration(p.estimated_finish_in_s)}{interval}): median run {runs}, "
        f"{ahead}, {loads}"
    )


def runs_text(runs: list[dict[str, Any]]) -> str:
    """The open batches and chains of `/api/queue`'s `runs`, one line each."""
    out = []
    for run in runs:
        found = run.get("progress")
        who = f" caller {run['caller']}" if run.get("caller") else ""
        line = f"{run.get('object', 'batch')} {run['id']} {run['status']}{who}"
        if found is not None:
            total = found.get("total")
            if total is None:  # a chain whose length was not given: what came so far
                sent = found["done"] + found["failed"] + found["running"] + found["waiting"]
                found = found | {"total": sent}
            text = progress_text(msgspec.convert(found, Progress))
            if total is None:
                text = text.replace(f"/{found['total']} done", "/? done", 1)
            line += ": " + text  # with the interval when the estimate gives one
        out.append(line)
    return "\n".join(out) + ("\n" if out else "")


def duration(seconds: float) -> str:
    """`42s`, `4m02s`, `2h03m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def memory(swap: SwapWaited) -> str:
    """What a swap says of GPU memory: the loaded model's footprint, what it
    evicted, and any wait for stopped models' memory ("" when none is known)."""
    parts = []
    if swap.gpu_memory_mib is not None:
        parts.append(f"{swap.to_model} holds {swap.gpu_memory_mib / 1024:.1f} GiB")
    if swap.evicted and (len(swap.evicted) > 1 or swap.evicted[0] != swap.from_model):
        parts.append(f"evicted {', '.join(swap.evicted)}")
    if swap.memory_wait_s is not None:
        parts.append(f"waited {seconds(swap.memory_wait_s)} for GPU memory")
    return f" [{'; '.join(parts)}]" if parts else ""


def _sleep_note(swap: SwapWaited) -> str:
    """What sleep did in a swap: `; woke qwen in 1.2 s; a cold start of flux costs 48 s:
    it was put to sleep instead` (empty when the swap stopped and cold-started)."""
    notes = list(swap.slept)
    if swap.woke_s is not None:
        notes.append(woke(swap.to_model, round(swap.woke_s * 1e9)))
    return "".join(f"; {note}" for note in notes)
