"""The rules of app/web/sites.py and their config keys (app/config/sites.py):
which requests change state, which `Host` is this server's, which `Origin`."""

from __future__ import annotations

import re
import socket
import textwrap
from pathlib import Path

import pytest

from app.config import ConfigError, parse_config
from app.runtime.reload import adopt
from app.web.sites import STATE_CHANGING_GETS, SiteRules, changes_state, is_own_origin

DOCS = Path(__file__).resolve().parents[2] / "docs"
MODELS = "models:\n  m:\n    cmd: server --port ${PORT}\n"


def _config(server: str = "") -> object:
    return parse_config(MODELS + ("server:\n" + textwrap.indent(server, "  ") if server else ""))


def _errors(server: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        _config(server)
    return str(raised.value).splitlines()


# -- the config keys ----------------------------------------------------------------


def test_the_lists_resolve_to_one_spelling() -> None:
    config = _config(
        "allowedHosts: [GPU.Example.com., .lan, '[::1]', gpu.example.com]\n"
        "allowedOrigins: ['HTTPS://Chat.example.com:443', 'http://localhost:3000/', '*']\n"
    )
    assert config.allowed_hosts == ("gpu.example.com", ".lan", "::1")  # type: ignore[attr-defined]
    assert config.allowed_origins == (  # type: ignore[attr-defined]
        "https://chat.example.com",
        "http://localhost:3000",
        "*",
    )


def test_a_bad_entry_is_an_error_naming_it_and_what_is_allowed() -> None:
    errors = _errors("allowedHosts: ['gpu.example.com:8080', 'http://gpu', 'two words']\n")
    assert errors[0].startswith("server.allowedHosts[0]: 'gpu.example.com:8080' has a port")
    assert errors[1].startswith("server.allowedHosts[1]: 'http://gpu' is not a host name")
    assert errors[2].startswith("server.allowedHosts[2]: 'two words' is not a host name")
    errors = _errors("allowedOrigins: ['null', 'https://a.example/path', 'ftp://a', a.example]\n")
    assert [e.split(":")[0] for e in errors] == [f"server.allowedOrigins[{i}]" for i in range(4)]
    assert "expected scheme://host[:port]" in errors[0]
    assert "did you mean 'allowedOrigins'" in _errors("allowedOrigin: ['https://a.example']\n")[0]


def test_a_config_without_the_keys_hashes_as_before() -> None:
    plain = parse_config(MODELS)
    assert plain.config_hash == parse_config(MODELS + "server: {allowedHosts: []}\n").config_hash
    listed = parse_config(MODELS + "server: {allowedHosts: [gpu.example.com]}\n")
    assert listed.config_hash != plain.config_hash


# -- what changes state ---------------------------------------------------------------


def test_what_changes_state() -> None:
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert changes_state("http", method, "/v1/models")
    for path in ("/unload", "/unload/", "//unload", "/props", "/v1/audio/voices/"):
        assert changes_state("http", "GET", path), path
        assert changes_state("http", "HEAD", path), path
    assert changes_state("http", "GET", "/upstream/A/health")
    assert changes_state("websocket", "GET", "/v1/models")  # every upgrade
    for path in ("/v1/models", "/running", "/api/queue", "/logs/stream", "/ui/", "/upstream"):
        assert not changes_state("http", "GET", path), path
    assert not changes_state("http", "OPTIONS", "/api/models/unload")  # a preflight


def test_the_docs_list_every_state_changing_get() -> None:
    http = (DOCS / "http.md").read_text()
    section = http[http.index("## Requests from other sites") :]
    section = section[: section.index("\n## ", 4)]
    listed = set(re.findall(r"`GET (/[^`\s]*)`", section))
    assert listed == {*STATE_CHANGING_GETS, "/upstream/MODEL/..."}


# -- Host and Origin ---------------------------------------------------------------------


def _rules(listen: str | None, server: str = "") -> SiteRules:
    return SiteRules(_config(server), listen)  # type: ignore[arg-type]


def test_the_host_is_localhost_an_address_an_intranet_name_or_a_listed_one() -> None:
    for listen in ("127.0.0.1", "0.0.0.0", "::"):
        rules = _rules(listen)
        for host in ("localhost:8080", "LOCALHOST", "ui.localhost", "127.0.0.1:1", "[::1]:8"):
            assert rules.host_refusal("/v1/models", host) is None, (listen, host)
        # From another machine, by address: a wildcard bind stays usable.
        assert rules.host_refusal("/v1/models", "192.168.1.20:8080") is None
        assert rules.host_refusal("/v1/models", "gpubox:8080") is None  # an intranet name
        refusal = rules.host_refusal("/v1/models", "evil.example:8080")
        assert refusal is not None and "server.allowedHosts (none set)" in refusal
        assert rules.host_refusal("/health", "evil.example") is None
        assert rules.host_refusal("/v1/models", None) is None  # HTTP/1.0: no browser
    machine = socket.gethostname().lower()
    assert _rules("0.0.0.0").host_refusal("/", f"{machine}:8080") is None
    assert _rules("gpu.internal").host_refusal("/", "gpu.internal:8080") is None
    listed = _rules("0.0.0.0", "allowedHosts: [gpu.example.com, .lan]\n")
    for host in ("gpu.example.com", "gpu.example.com.:443", "a.b.lan", "lan"):
        assert listed.host_refusal("/", host) is None, host
    for host in ("example.com", "a.xlan", "gpu.example.com.evil"):
        assert listed.host_refusal("/", host) is not None, host
    assert _rules("0.0.0.0", "allowedHosts: ['*']\n").host_refusal("/", "evil.example") is None
    assert _rules(None).host_refusal("/", "testserver") is None  # no listen address: no check


def test_an_origin_is_the_servers_own_when_its_host_and_port_are_the_hosts() -> None:
    assert is_own_origin("http://127.0.0.1:8080", "127.0.0.1:8080")
    assert is_own_origin("https://gpu.example.com", "gpu.example.com")  # a TLS proxy
    assert is_own_origin("http://[::1]:8080", "[::1]:8080")
    assert not is_own_origin("http://127.0.0.1:3000", "127.0.0.1:8080")
    assert not is_own_origin("http://evil.example", "127.0.0.1")
    assert not is_own_origin("null", "127.0.0.1")
    assert not is_own_origin("http://127.0.0.1", None)


def test_cross_site_rules() -> None:
    rules = _rules("127.0.0.1", "allowedOrigins: ['https://app.example']\n")
    host = {"host": "127.0.0.1:8080"}
    passes = [
        {},  # curl, the OpenAI clients
        {"sec-fetch-site": "none"},  # typed in the address bar
        {"sec-fetch-site": "same-origin", "origin": "http://127.0.0.1:8080"},
        # Behind a proxy that rewrites Host: the browser's own word is trusted.
        {"sec-fetch-site": "same-origin", "origin": "https://gpu.example.com"},
        {"origin": "http://127.0.0.1:8080"},  # a browser without Fetch Metadata
        {"sec-fetch-site": "cross-site", "origin": "https://app.example"},  # listed
        {"sec-fetch-site": "cross-site", "origin": "https://app.example:443"},
    ]
    for headers in passes:
        assert rules.cross_site_refusal(host | headers) is None, headers
    refused = [
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site", "origin": "http://127.0.0.1:3000"},
        {"origin": "http://evil.example"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site", "origin": "http://app.example"},  # not https
    ]
    for headers in refused:
        refusal = rules.cross_site_refusal(host | headers)
        assert refusal is not None and "server.allowedOrigins" in refusal, headers
    anyone = _rules("127.0.0.1", "allowedOrigins: ['*']\n")
    assert anyone.cross_site_refusal(host | {"origin": "http://evil.example"}) is None
    assert anyone.cross_site_refusal(host | {"sec-fetch-site": "cross-site"}) is None


def test_a_reload_changes_the_lists_of_the_running_rules() -> None:
    config = parse_config(MODELS)
    rules = SiteRules(config, "127.0.0.1")
    foreign = {"host": "127.0.0.1:8080", "origin": "https://app.example"}
    assert rules.cross_site_refusal(foreign) is not None
    assert rules.host_refusal("/", "gpu.example.com") is not None
    listed = "server: {allowedHosts: [gpu.example.com], allowedOrigins: ['https://app.example']}\n"
    adopt(config, parse_config(MODELS + listed))  # what SIGHUP does, in place
    assert rules.cross_site_refusal(foreign) is None
    assert rules.host_refusal("/", "gpu.example.com") is None
