"""A chain's progress as its caller and the console read it: its shots done,
running, waiting and failed, the shots the caller said are still to come, and
an estimated finish, by the one estimator batches use (app/report/progress.py),
with the forecast of overtaking work and the producer's gap between shots.

A chain (`X-Gpulane-Chain`) is named by its requests' enqueues in the log; the
chains are kept in memory (app/jobs/chain_index.py), each enqueue read once.
No HTTP: a chain a caller may not see is `NotFound`, as if it did not exist."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from sqlalchemy import Engine

from app.core.lane_history import LaneHistory
from app.core.scoring import NS_PER_S
from app.jobs.chain_index import Chain, ChainIndex, ChainKey
from app.jobs.errors import Conflict, NotFound
from app.report.live_queue import Times
from app.report.progress import Progress, ended_well, progress
from app.runtime.api import LiveState
from app.runtime.scheduler import Scheduler
from app.store.chains import chain_enqueues, shot_rows

CHAIN_GAP_S = 300.0
"""A chain with nothing queued or running stays open this long after its latest
shot ended, unless its length says every shot has been sent: the producer sends
the next shot when the previous one is done."""
RECENT_S = 86400.0
"""Chains whose latest shot arrived longer ago than this, with nothing open, are
not looked at for `/api/queue`'s open runs."""
PROGRESS_MAX_AGE_S = 1.0


class ChainProgress:
    def __init__(self, scheduler: Scheduler, engine: Engine) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self.index = ChainIndex()
        self._reading = asyncio.Lock()
        self._cache: dict[ChainKey, tuple[float, dict[str, Any]]] = {}

    async def runs(self, caller: str | None) -> list[dict[str, Any]]:
        """The open chains (only `caller`'s when given) with their progress, for
        `/api/queue`'s `runs` and `gpulane queue`, oldest first."""
        await self._catch_up()
        live = self.scheduler.live()
        candidates: dict[ChainKey, Chain] = {}
        for rid in live.state.requests:
            found = self.index.of_request(rid)
            if found is not None:
                candidates[found[0].key] = found[0]
        recent = live.now_ns - RECENT_S * NS_PER_S
        quiet = [
            c
            for c in self.index.chains.values()
            if c.key not in candidates and c.last_at_ns >= recent and _more_may_come(c)
        ]
        if quiet:
            rows = await asyncio.to_thread(shot_rows, self.engine, [c.shots[-1] for c in quiet])
            for c in quiet:
                ended = rows.get(c.shots[-1], {}).get("finished_at")
                if ended is None or live.now_ns / NS_PER_S - ended < CHAIN_GAP_S:
                    candidates[c.key] = c
        chosen = [c for c in candidates.values() if caller is None or c.caller == caller]
        return [await self._view(c) for c in sorted(chosen, key=lambda c: c.first_at_ns)]

    async def listing(self, viewer: str | None, limit: int) -> list[dict[str, Any]]:
        """The chains `viewer` may see (None: every caller's), the latest to get a
        shot first, with their progress: the console's Chains page."""
        await self._catch_up()
        seen = [c for c in self.index.chains.values() if viewer is None or c.caller == viewer]
        seen.sort(key=lambda c: c.last_at_ns, reverse=True)
        return [await self._view(c) for c in seen[:limit]]

    async def run_of(self, request_id: str) -> dict[str, Any] | None:
        """The chain a request is a shot of, with its progress and the shot's place
        (`shot`), for explain; None for a request of no chain."""
        await self._catch_up()
        found = self.index.of_request(request_id)
        if found is None:
            return None
        chain, place = found
        return await self._view(chain) | {"shot": place}

    async def chain(
        self,
        viewer: str | None,
        chain_id: str,
        caller: str | None,
        offset: int = 0,
        limit: int = 200,
    ) -> dict[str, Any]:
        """The chain `chain_id` with its progress, and its shots `offset` on (at most
        `limit`), each with its request's status. `viewer`: the caller a user key
        lists (None: an admin, who names the caller with `caller` when several
        have a chain of that id, "" for the anonymous one). NotFound when there is
        none the viewer may see."""
        await self._catch_up()
        named = self.index.named(chain_id)
        if viewer is not None:
            named = [c for c in named if c.caller == viewer]
        elif caller is not None:  # "" names the anonymous caller (no label is empty)
            named = [c for c in named if c.caller == (caller or None)]
        if not named:
            raise NotFound(f"no chain {chain_id!r}", "chain_not_found")
        if len(named) > 1:
            callers = ", ".join(sorted(c.caller or "(no caller)" for c in named))
            raise Conflict(
                f"chain {chain_id!r} is the name of chains of several callers ({callers}); "
                "name one with ?caller=",
                "chain_ambiguous",
            )
        chain = named[0]
        view = await self._view(chain)
        page = chain.shots[offset : offset + limit]
        rows = await asyncio.to_thread(shot_rows, self.engine, page)
        shots = [
            {
                "shot": offset + i + 1,
                "request_id": rid,
                "status": rows[rid]["status"] if rid in rows else "queued",
                "http_status": rows[rid]["http_status"] if rid in rows else None,
            }
            for i, rid in enumerate(page)
        ]
        return view | {"shots": shots, "shots_offset": offset}

    async def _catch_up(self) -> None:
        """Fold in the enqueues naming a chain logged since the last look."""
        async with self._reading:
            found, last = await asyncio.to_thread(chain_enqueues, self.engine, self.index.position)
            self.index.fold(found, last)

    async def _view(self, chain: Chain) -> dict[str, Any]:
        now = time.monotonic()
        cached = self._cache.get(chain.key)
        if cached is not None and now - cached[0] < PROGRESS_MAX_AGE_S:
            return cached[1]
        found = await self.progress(chain)
        view = {
            "id": chain.id,
            "object": "chain",
            "caller": chain.caller,
            "status": "in_progress" if found.running or found.waiting else "ended",
            "length": chain.length,
            "sent": len(chain.shots),
            "model": chain.model,
            "first_at": chain.first_at_ns / NS_PER_S,
            "last_at": chain.last_at_ns / NS_PER_S,
            # `total` only when the caller gave the length: else it counts what came so far.
            "progress": msgspec.to_builtins(found) | {"total": chain.length},
        }
        self._cache = {k: v for k, v in self._cache.items() if now - v[0] < PROGRESS_MAX_AGE_S}
        self._cache[chain.key] = (now, view)
        return view

    async def progress(self, chain: Chain) -> Progress:
        """Its shots done, running, waiting and failed, those not sent yet (from
        its length) and an estimated finish (app/report/progress.py)."""
        rows = await asyncio.to_thread(shot_rows, self.engine, chain.shots)
        times = self.scheduler.durations()  # the queue's own
        live = self.scheduler.live()  # one snapshot for the count and the estimate
        return chain_progress(chain, rows, live, times, self.scheduler.lane_history)


def chain_progress(
    chain: Chain,
    rows: dict[str, Any],
    live: LiveState,
    times: Times,
    history: LaneHistory | None = None,
) -> Progress:
    """`progress` of a chain whose shots' `requests` rows are `rows`: with
    `history`, the forecast of overtaking work and the interval, and the
    producer's mean gap before each shot not sent yet."""
    done = failed = 0
    open_ids: list[str] = []
    for rid in chain.shots:
        row = rows.get(rid)
        if rid in live.state.requests:
            open_ids.append(rid)
        elif row is None or ended_well(row["status"], row["http_status"]):
            done += 1
        else:
            failed += 1
    unsent = max(0, (chain.length or 0) - len(chain.shots))
    return progress(
        live.state,
        live.running_since,
        live.now_ns,
        times,
        open_ids,
        done=done,
        failed=failed,
        unqueued_models=[chain.model] * unsent,
        history=history,
        gap_s=producer_gap_s(chain.shots, rows),
    )


def producer_gap_s(shots: list[str], rows: dict[str, Any]) -> float:
    """The producer's mean gap: from a shot's end to the next shot's enqueue (0
    when none is known). Shots sent before the previous one ended have none."""
    gaps = []
    for before, after in zip(shots, shots[1:], strict=False):
        ended = rows.get(before, {}).get("finished_at")
        sent = rows.get(after, {}).get("enqueued_at")
        if ended is not None and sent is not None and sent >= ended:
            gaps.append(sent - ended)
    return sum(gaps) / len(gaps) if gaps else 0.0


def _more_may_come(chain: Chain) -> bool:
    return chain.length is None or len(chain.shots) < chain.length
