"""Peers: other servers whose models are served here, with the queue in front.

A peer (llama-swap's `peers`: another gpulane, a llama-swap, any
OpenAI-compatible server) is a pool of slots: at most `slots` requests are
sent to it at once, whichever of its models they name. Each of its models is a
model entry `<peer>/<model>` with no process: it is "loaded" by a reachability
probe, never evicted, and in the router a persistent, non-exclusive group of
its own, so it neither evicts nor is evicted. A bare model id that several
peers serve (and no local model) is a *choice*: its requests queue as one model
and each is dispatched to one of those entries, decided here:

- a reachable peer with a free slot, the one the model was last sent to first,
  then in configuration order;
- peers whose last probe failed (`SchedulerState.load_failures`) are passed
  over while another one serves the model, so a request a dead peer failed is
  retried on another one.

Swap affinity follows what was last sent to each peer: of a peer's models,
only that one has the bonus (a single-GPU peer has it loaded), and a choice
has it when its last target has.

`server_started.peers` and `.peer_choices` carry all of it, and the choice of
a target is recorded as `request_dispatched.model`, so `replay --verify`
reproduces it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

import msgspec


class PeerPool(msgspec.Struct, frozen=True, kw_only=True):
    """One peer as the scheduler sees it: its slots and its model entries."""

    slots: int = 1
    """Requests in flight at once across its models (`concurrencyLimit`)."""
    models: tuple[str, ...] = ()
    """Its model entries (`<peer>/<model>`), in configuration order."""


def fqn(peer: str, model: str) -> str:
    """The id of a peer's model here: `<peer>/<model>`, as llama-swap names it."""
    return f"{peer}/{model}"


def candidates(
    choices: Iterable[str],
    last: str | None,
    failing: Set[str],
    blocked: Set[str],
) -> list[str]:
    """The entries a request for a choice may go to, best first: the last one
    used, then configuration order; those whose last probe failed (`failing`)
    only when every entry fails; none that is `blocked` (backing off)."""
    ordered = list(choices)
    if last in ordered:
        ordered.remove(last)
        ordered.insert(0, last)
    healthy = [m for m in ordered if m not in failing and m not in blocked]
    if healthy:
        return healthy
    return [m for m in ordered if m not in blocked]


def another_peer_left(choices: Iterable[str], failed: str, failing: Set[str]) -> bool:
    """The probe of `failed`, one peer's entry for a choice, failed: is another
    entry left to retry the request on (one whose last probe did not fail)?"""
    return any(m != failed and m not in failing for m in choices)


def affine(
    in_use: frozenset[str],
    peer_of: Mapping[str, str],
    last_sent: Mapping[str, str],
    last_target: Mapping[str, str],
) -> frozenset[str]:
    """The models whose requests get the swap-affinity bonus: the local models in
    use, of each peer the model last sent to it (while reachable), and each
    choice whose last target is one of those."""
    if not peer_of:
        return in_use
    sent = {m for m in last_sent.values() if m in in_use}
    kept = {m for m in in_use if m not in peer_of} | sent
    kept.update(choice for choice, target in last_target.items() if target in sent)
    return frozenset(kept)
