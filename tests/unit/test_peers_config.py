"""llama-swap's `peers` (issue 24, item 4): each peer's models are model entries
`<peer>/<model>` with no process, a bare id names them when no local model
does, and the router gets a persistent, non-exclusive group per peer."""

from __future__ import annotations

import textwrap

import pytest

from app.config import ConfigError, parse_config
from app.config.resolved import config_hash, masked
from app.core.peers import PeerPool
from app.core.residency import DEFAULT_GROUP, GroupRouter, to_evict

LOCAL = """
models:
  local:
    cmd: server --port ${PORT}
    aliases: [shared]
"""


def load(peers: str, models: str = LOCAL, environ: dict[str, str] | None = None) -> object:
    return parse_config(textwrap.dedent(models) + textwrap.dedent(peers), environ=environ or {})


PEERS = """
peers:
  box2:
    proxy: http://box2:8080/
    apiKey: ${env.BOX2_KEY}
    models: [some-model, both, shared, local, some-model]
    concurrencyLimit: 2
    filters:
      stripParams: top_k
      setParams: {temperature: 0.5}
    timeouts: {connect: 5, responseHeader: 60, keepalive: 30}
  box3:
    proxy: http://box3:8080
    models: [both]
"""


def test_each_peer_model_is_an_entry_with_no_process() -> None:
    config = parse_config(textwrap.dedent(LOCAL + PEERS), environ={"BOX2_KEY": "sk-2"})
    entry = config.models["box2/some-model"]
    assert entry.cmd == () and entry.peer == "box2" and entry.port is None
    assert entry.proxy == "http://box2:8080"
    assert entry.use_model_name == "some-model"  # the peer's own name goes in the body
    assert entry.headers == {"authorization": "Bearer sk-2", "x-api-key": "sk-2"}
    assert entry.pass_credentials == ()  # the peer's key replaces the client's
    assert entry.strip_params == ("top_k",) and entry.set_params == {"temperature": 0.5}
    assert (entry.connect_timeout, entry.response_header_timeout) == (5, 60)
    assert config.peers == {
        "box2": PeerPool(
            slots=2, models=("box2/some-model", "box2/both", "box2/shared", "box2/local")
        ),
        "box3": PeerPool(slots=1, models=("box3/both",)),
    }
    warned = [w.split(":")[0] for w in config.warnings]
    assert warned == ["peers.box2.timeouts.keepalive", "peers.box2.filters"]
    assert "the peers serving 'both' have different filters" in config.warnings[1]
    assert config.models["box3/both"].headers == {}
    assert "sk-2" not in str(masked(config)) and "sk-2" not in repr(config_hash(config))


def test_ids_local_first_then_one_peer_then_a_choice() -> None:
    config = parse_config(textwrap.dedent(LOCAL + PEERS), environ={"BOX2_KEY": "k"})
    # A local id or alias wins over a peer's bare id, as in llama-swap.
    assert config.resolve_model("local") == "local"
    assert config.resolve_model("shared") == "local"
    assert config.resolve_model("box2/local") == "box2/local"
    # Exactly one peer serves it: the bare id is that peer's entry.
    assert config.resolve_model("some-model") == "box2/some-model"
    # Several peers: a choice, dispatched to one of them by the scheduler.
    assert config.resolve_model("both") == "both"
    assert config.models["both"].choices == ("box2/both", "box3/both")
    assert config.models["both"].use_model_name == "both"
    assert config.resolve_model("box4/both") is None


def test_a_peer_name_that_is_a_local_id_or_alias_is_an_error() -> None:
    models = """
    models:
      box2/a:
        cmd: server --port ${PORT}
      other:
        cmd: server --port ${PORT}
        aliases: [box2/b]
    """
    peers = "peers:\n  box2:\n    proxy: http://box2\n    models: [a, b]\n"
    with pytest.raises(ConfigError) as err:
        load(peers, models)
    text = str(err.value)
    assert "peers.box2.models[0]: 'box2/a' is also a local model id" in text
    assert "peers.box2.models[1]: 'box2/b' is also a local alias of 'other'" in text


def test_an_ambiguous_full_name_and_bad_values_are_errors() -> None:
    peers = """
    peers:
      a:
        proxy: http://a
        models: [b/c]
      a/b:
        proxy: ftp://x
        models: [c]
        concurrencyLimit: 0
      empty:
        proxy: http://e
        models: []
    """
    with pytest.raises(ConfigError) as err:
        load(peers)
    text = str(err.value)
    assert "peers.a/b.models[0]: 'a/b/c' is ambiguous: peers.a serves the same name" in text
    assert "peers.a/b.proxy: 'ftp://x' is not an http:// or https:// URL" in text
    assert "peers.a/b.concurrencyLimit: 0 is out of range" in text
    assert "peers.empty.models: a peer must list at least one model" in text


def test_peers_are_persistent_groups_that_neither_evict_nor_are_evicted() -> None:
    config = parse_config(textwrap.dedent(LOCAL + PEERS), environ={"BOX2_KEY": "k"})
    router = config.router
    assert isinstance(router, GroupRouter)
    default = router.groups[0]
    assert default.name == DEFAULT_GROUP and default.members == ("local",)
    assert default.swap and default.exclusive  # the local models: one at a time, as before
    peer = router.group_of("box2/both")
    assert peer is not None and peer.persistent and not peer.exclusive and not peer.swap
    everything = {"box2/both", "box3/both", "box2/local"}
    assert to_evict(router, "local", everything) == frozenset()
    assert to_evict(router, "box2/both", everything | {"local"}) == frozenset()


def test_a_config_without_peers_hashes_and_routes_as_before() -> None:
    config = load("")
    assert config.router is None and config.peers == {}
    hashed = config_hash(config)
    assert hashed == config_hash(load("peers: {}\n"))


def test_with_a_matrix_router_peers_warn_and_are_not_served() -> None:
    matrix = """
    routing:
      router:
        use: matrix
        settings:
          matrix:
            sets: {one: local}
    peers:
      box2: {proxy: "http://box2", models: [a]}
    """
    config = load(matrix)
    assert config.resolve_model("box2/a") is None
    assert any(w.startswith("peers: not used with a matrix router") for w in config.warnings)
