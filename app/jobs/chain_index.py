"""The chains the log names, kept in memory: a fold of the enqueues that name a
chain (`X-Gpulane-Chain`, read by app/store/chains.py), each event read once.
Pure: the reader passes what it read and where it stopped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from app.store.chains import ChainEnqueue

ChainKey = tuple[str | None, str]
"""(caller, chain id): ids are per caller, so two callers' `film-1` never mix."""


@dataclass(slots=True)
class Chain:
    caller: str | None
    id: str
    length: int | None = None
    """The total as the caller last gave it (`X-Gpulane-Chain-Length`); None: unknown."""
    shots: list[str] = field(default_factory=list)
    """Its requests, in the order they first arrived."""
    model: str = ""
    """The model of its latest request: what the shots not sent yet are counted on."""
    first_at_ns: int = 0
    last_at_ns: int = 0
    """When its first and latest requests arrived (unix ns)."""

    @property
    def key(self) -> ChainKey:
        return (self.caller, self.id)


class ChainIndex:
    def __init__(self) -> None:
        self.chains: dict[ChainKey, Chain] = {}
        self._place: dict[str, tuple[ChainKey, int]] = {}
        """request id -> (its chain, its place there, 1-based)."""
        self.position = 0
        """The last event seq folded in."""

    def fold(self, enqueues: Iterable[ChainEnqueue], position: int) -> None:
        """Take the enqueues read after `self.position`, up to `position`. A later
        attempt of a request keeps its place; a length given later wins."""
        for e in enqueues:
            key = (e.caller, e.chain)
            chain = self.chains.get(key)
            if chain is None:
                chain = self.chains[key] = Chain(e.caller, e.chain, first_at_ns=e.at_ns)
            if e.request_id not in self._place:
                chain.shots.append(e.request_id)
                self._place[e.request_id] = (key, len(chain.shots))
            if e.chain_length is not None:
                chain.length = e.chain_length
            chain.model = e.model
            chain.last_at_ns = max(chain.last_at_ns, e.at_ns)
        self.position = max(self.position, position)

    def of_request(self, request_id: str) -> tuple[Chain, int] | None:
        """The chain a request belongs to and its place there, or None."""
        found = self._place.get(request_id)
        return None if found is None else (self.chains[found[0]], found[1])

    def named(self, chain_id: str) -> list[Chain]:
        """Every caller's chain with this id (an id is unique per caller)."""
        return [c for (_, cid), c in self.chains.items() if cid == chain_id]
