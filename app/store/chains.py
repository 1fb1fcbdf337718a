"""The queries of chains (`X-Gpulane-Chain`). A chain has no table: its requests'
`request_enqueued` events name it (`chain`, `chain_length`, with `caller`), and
each shot's outcome is its row in `requests`. The functions given an engine open
their own connection, so the web layer calls them in a thread."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import sqlalchemy
from sqlalchemy import Engine, func, select

from app.core import events as ev
from app.store.tables import events, requests

_NAMES_A_CHAIN = '%"chain":"%'
"""What the JSON of an enqueue naming a chain holds (`"chain":null` otherwise)."""
_IN_CHUNK = 500


class ChainEnqueue(NamedTuple):
    """One `request_enqueued` naming a chain."""

    seq: int
    request_id: str
    caller: str | None
    chain: str
    chain_length: int | None
    model: str
    at_ns: int


def chain_enqueues(engine: Engine, after_seq: int) -> tuple[list[ChainEnqueue], int]:
    """The enqueues naming a chain with seq > `after_seq`, in seq order, and the
    last seq looked at (the next call's `after_seq`): a reader keeping chains in
    memory reads each event once."""
    with engine.connect() as conn:
        last = conn.execute(select(func.max(events.c.seq))).scalar() or 0
        if last <= after_seq:
            return [], after_seq
        return _enqueues(conn, after_seq, last), last


def _enqueues(
    conn: sqlalchemy.Connection, after_seq: int, upto_seq: int, chain: str | None = None
) -> list[ChainEnqueue]:
    # An id has no quote or backslash (app/web/chain_headers.py), so it is in the
    # JSON as it is; a `_` in it matches any character here, and the decode decides.
    like = _NAMES_A_CHAIN if chain is None else f'%"chain":"{chain}"%'
    query = (
        select(events.c.seq, events.c.data)
        .where(
            events.c.seq > after_seq,
            events.c.seq <= upto_seq,
            events.c.type == "request_enqueued",
            events.c.data.like(like),
        )
        .order_by(events.c.seq)
    )
    out = []
    for seq, data in conn.execute(query):
        e = ev.decode(data)
        if isinstance(e, ev.RequestEnqueued) and e.chain is not None:
            at = e.enqueued_at if e.enqueued_at is not None else e.at
            out.append(
                ChainEnqueue(seq, e.request_id, e.caller, e.chain, e.chain_length, e.model, at)
            )
    return out


def chain_place(
    conn: sqlalchemy.Connection, caller: str | None, chain: str, request_id: str
) -> tuple[int, int | None]:
    """Where `request_id` stands in its chain: its place in the order the chain's
    requests first arrived (1 for the first; 0 if it is not one of them), and the
    chain's length as last given (None if never)."""
    order: dict[str, int] = {}
    length: int | None = None
    for e in _enqueues(conn, 0, 1 << 62, chain):
        if e.chain == chain and e.caller == caller:
            order.setdefault(e.request_id, len(order) + 1)
            if e.chain_length is not None:
                length = e.chain_length
    return order.get(request_id, 0), length


def shot_rows(engine: Engine, request_ids: Collection[str]) -> dict[str, Any]:
    """`requests` rows (status, http_status, enqueued_at, finished_at) of the ids,
    by id."""
    ids = list(request_ids)
    out: dict[str, Any] = {}
    columns = (
        requests.c.id,
        requests.c.status,
        requests.c.http_status,
        requests.c.enqueued_at,
        requests.c.finished_at,
    )
    with engine.connect() as conn:
        for i in range(0, len(ids), _IN_CHUNK):
            chunk = ids[i : i + _IN_CHUNK]
            for row in conn.execute(select(*columns).where(requests.c.id.in_(chunk))).mappings():
                out[row["id"]] = row
    return out
