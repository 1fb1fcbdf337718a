"""Resolving llama-swap's `peers` into model entries and the core's peer pools.

Each model a peer lists becomes a model entry `<peer>/<model>` (llama-swap's
fully qualified name) with no process: its `proxy` is the peer's, the peer's
`apiKey` is sent as `Authorization: Bearer` and `x-api-key`, its filters apply,
and the body's `model` is the peer's own name for it. A bare model id is served
by the peers too, local ids and aliases first (as llama-swap): an alias of the
one entry when exactly one peer serves it, and a *choice* (a model entry with
`choices`: the scheduler picks a peer at dispatch) when several do.

Every peer is a persistent, non-exclusive, non-swapping group of the router, so
its models neither evict nor are evicted; without a router the local models
form the implicit group `(default)` (`swap`, `exclusive`: one at a time, as
before). A matrix router does not take peers yet: they load with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from app.config.checks import Issues, join_path
from app.config.macros import Expander, expand
from app.config.models import http_url, pass_credentials, set_params, strip_params
from app.config.raw import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RESPONSE_HEADER_TIMEOUT,
    RawConfig,
    RawPeer,
)
from app.config.resolved import ModelConfig
from app.config.values import RunLimits, limit
from app.core.peers import PeerPool, fqn
from app.core.residency import (
    DEFAULT_GROUP,
    Group,
    GroupRouter,
    MatrixRouter,
    MemoryRouter,
    Router,
)

PEER_GROUP: Final = "peers.{}"
"""The router group of a peer's models."""
CHOICE_GROUP: Final = "peers"
"""The router group of the bare ids several peers serve."""


def peer_headers(api_key: str) -> dict[str, str]:
    """What a peer's `apiKey` adds to each request, as llama-swap sends it."""
    if not api_key:
        return {}
    return {"authorization": f"Bearer {api_key}", "x-api-key": api_key}


class PeerResolver:
    def __init__(
        self,
        raw: RawConfig,
        issues: Issues,
        environ: Mapping[str, str],
        origins: Mapping[str, str],
        run_limits: RunLimits,
    ) -> None:
        self.raw = raw
        self.issues = issues
        self.run_limits = run_limits
        self.expander = Expander(raw.macros, environ=environ, origins=origins)

    def run(
        self, models: dict[str, ModelConfig], index: dict[str, str], router: Router | None
    ) -> tuple[dict[str, PeerPool], Router | None]:
        """Add each peer's model entries to `models` and their names to `index`;
        returns the pools and the router with a group per peer."""
        peers = self.raw.peers
        if not peers:
            return {}, router
        if isinstance(router, MatrixRouter | MemoryRouter):
            self.issues.warn(
                "peers",
                f"not used with a {'matrix' if isinstance(router, MatrixRouter) else 'memory'} "
                "router yet: their models are not served (use routing.router.use: group, "
                "or no router)",
            )
            return {}, router
        local = dict(index)
        pools: dict[str, PeerPool] = {}
        owner: dict[str, str] = {}  # entry id -> peer
        bare: dict[str, list[str]] = {}
        for peer_id in sorted(peers):
            pool = self._peer(peer_id, peers[peer_id], models, local, owner, bare)
            if pool is not None:
                pools[peer_id] = pool
        for name, entries in bare.items():
            if name in local or name in owner:
                continue  # local ids and aliases first; a full name beats a bare one
            if len(entries) == 1:
                index[name] = entries[0]
            else:
                models[name] = self._choice(name, [models[e] for e in entries])
                index[name] = name
        for entry in owner:
            index[entry] = entry
        return pools, self._router(router, pools, models)

    def _peer(
        self,
        peer_id: str,
        peer: RawPeer,
        models: dict[str, ModelConfig],
        local: Mapping[str, str],
        owner: dict[str, str],
        bare: dict[str, list[str]],
    ) -> PeerPool | None:
        path = join_path("peers", peer_id)
        proxy = self._proxy(peer.proxy, f"{path}.proxy")
        api_key = expand(self.issues, self.expander, peer.api_key, f"{path}.apiKey") or ""
        if not peer.models:
            self.issues.error(f"{path}.models", "a peer must list at least one model")
        slots = peer.concurrency_limit
        if slots < 1:
            self.issues.error(
                f"{path}.concurrencyLimit", f"{slots} is out of range; expected an integer >= 1"
            )
            slots = 1
        strip = strip_params(
            self.issues, peer.filters, self.expander, f"{path}.filters.stripParams"
        )
        params = set_params(self.issues, peer.filters, path)
        headers = peer_headers(api_key)
        # The peer's key replaces the client's credentials; without one they are
        # passed as for a local model.
        passed = (
            ()
            if api_key
            else pass_credentials(self.issues, None, bool(self.raw.api_keys), f"{path}.apiKey")
        )
        entries: list[str] = []
        for i, name in enumerate(dict.fromkeys(peer.models)):
            where = f"{path}.models[{i}]"
            if not name.strip():
                self.issues.error(where, "a model name must not be empty")
                continue
            entry = fqn(peer_id, name)
            if entry in local:
                what = "model id" if local[entry] == entry else f"alias of {local[entry]!r}"
                self.issues.error(where, f"{entry!r} is also a local {what}; rename one of them")
                continue
            if entry in owner:
                self.issues.error(
                    where,
                    f"{entry!r} is ambiguous: peers.{owner[entry]} serves the same name",
                )
                continue
            owner[entry] = peer_id
            bare.setdefault(name, []).append(entry)
            entries.append(entry)
            models[entry] = ModelConfig(
                id=entry,
                cmd=(),
                cmd_stop=None,
                proxy=proxy,
                aliases=(),
                env={},
                check_endpoint=None,
                ttl=0.0,
                unload_timeout=0.0,
                unlisted=False,
                use_model_name=name,
                name=f"{peer_id}: {name}",
                description=None,
                strip_params=strip,
                set_params=params,
                concurrency_limit=slots,
                metadata={},
                port=None,
                send_loading_state=self.raw.send_loading_state,
                connect_timeout=limit(
                    self.issues,
                    peer.timeouts.connect,
                    f"{path}.timeouts.connect",
                    DEFAULT_CONNECT_TIMEOUT,
                    durations=False,
                ),
                response_header_timeout=limit(
                    self.issues,
                    peer.timeouts.response_header,
                    f"{path}.timeouts.responseHeader",
                    DEFAULT_RESPONSE_HEADER_TIMEOUT,
                    durations=False,
                ),
                max_run_time=self.run_limits.max_run_time,
                stream_idle_timeout=self.run_limits.stream_idle_timeout,
                pass_credentials=passed,
                peer=peer_id,
                headers=headers,
            )
        return PeerPool(slots=slots, models=tuple(entries)) if entries else None

    def _choice(self, name: str, entries: list[ModelConfig]) -> ModelConfig:
        """A bare id several peers serve: its requests queue as one model and go to
        whichever of `entries` the scheduler picks."""
        first = entries[0]
        if any(
            (e.strip_params, e.set_params) != (first.strip_params, first.set_params)
            for e in entries
        ):
            self.issues.warn(
                f"peers.{first.peer}.filters",
                f"the peers serving {name!r} have different filters: a request for {name!r} "
                f"gets those of peers.{first.peer}; name the peer ({first.id!r}) to choose",
            )
        peers = ", ".join(e.peer or "" for e in entries)
        return ModelConfig(
            **{
                **{f: getattr(first, f) for f in ModelConfig.__struct_fields__},
                "id": name,
                "proxy": "",
                "name": name,
                "description": f"served by peers {peers}",
                "peer": None,
                "headers": {},
                "choices": tuple(e.id for e in entries),
            }
        )

    def _proxy(self, text: str, where: str) -> str:
        expanded = expand(self.issues, self.expander, text, where)
        if expanded is None:
            return ""
        return http_url(self.issues, expanded, where)

    def _router(
        self,
        router: Router | None,
        pools: Mapping[str, PeerPool],
        models: Mapping[str, ModelConfig],
    ) -> Router | None:
        """The router with one persistent, non-exclusive, non-swapping group per
        peer; without one, the local models are the implicit `(default)` group."""
        if not pools:
            return router
        if router is None:
            local = tuple(m for m, spec in sorted(models.items()) if not _remote(spec))
            groups: list[Group] = [Group(name=DEFAULT_GROUP, members=local)] if local else []
        else:
            assert isinstance(router, GroupRouter)
            groups = list(router.groups)
        taken = {g.name for g in groups}
        if CHOICE_GROUP in taken:
            self.issues.error("peers", f"the router group {CHOICE_GROUP!r} is reserved for peers")
        for peer_id, pool in pools.items():
            name = PEER_GROUP.format(peer_id)
            if name in taken:
                self.issues.error(
                    join_path("peers", peer_id), f"its router group {name!r} is already a group"
                )
                continue
            groups.append(
                Group(name=name, members=pool.models, swap=False, exclusive=False, persistent=True)
            )
        choices = tuple(m for m, spec in sorted(models.items()) if spec.choices)
        if choices:
            # Never loaded themselves (a request runs on a peer's entry), but every
            # model has a group: like the peers', they neither evict nor are evicted.
            groups.append(
                Group(
                    name=CHOICE_GROUP, members=choices, swap=False, exclusive=False, persistent=True
                )
            )
        return GroupRouter(groups=tuple(groups))


def _remote(spec: ModelConfig) -> bool:
    return spec.peer is not None or bool(spec.choices)
