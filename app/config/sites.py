"""`server.allowedHosts` and `server.allowedOrigins`: who may reach gpulane
from a browser (app/web/sites.py applies them), and the one spelling of a host
name and of an origin both sides compare.

A host entry is a name without scheme or port (`gpu.example.com`); a leading
dot also matches every subdomain (`.example.com`), as Vite's
`server.allowedHosts`; `*` turns the Host check off. An origin entry is what a
browser sends in `Origin`: `scheme://host[:port]` with no path (`*`: any
origin). Both are pure text: no lookup, no clock.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final
from urllib.parse import urlsplit

from app.config.checks import Issues
from app.config.raw import RawConfig

ANY: Final = "*"
_DEFAULT_PORTS: Final = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_NAME: Final = re.compile(
    r"\.?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*"
)


def split_host(host: str) -> tuple[str, int | None]:
    """A `Host` value (`name:port`, `[v6]:port`, `name`) as its name, lower
    case and without a trailing dot, and its port (None: none given)."""
    host = host.strip().lower()
    port = ""
    if host.startswith("[") and "]" in host:
        end = host.index("]")
        name, rest = host[1:end], host[end + 1 :]
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:
        name = host
    return name.rstrip("."), int(port) if port.isdigit() else None


def host_name(host: str) -> str:
    return split_host(host)[0]


def default_port(scheme: str) -> int:
    return _DEFAULT_PORTS[scheme]


def is_ip_literal(name: str) -> bool:
    """An address, which no DNS answer can point elsewhere (DNS rebinding needs a name)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def origin_key(origin: str, default_scheme: str = "http") -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin (`https://chat.example`), the default
    port filled in; None if it is not an origin (`null`, a path, no host)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = (parts.scheme or default_scheme).lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    if parts.query or parts.fragment or parts.username or parts.password:
        return None
    return scheme, parts.hostname.rstrip("."), port or _DEFAULT_PORTS[scheme]


def resolve_allowed_hosts(raw: RawConfig, issues: Issues) -> tuple[str, ...]:
    out: list[str] = []
    for i, entry in enumerate(raw.server.allowed_hosts):
        name = entry.strip().lower().rstrip(".")
        where = f"server.allowedHosts[{i}]"
        if name == ANY:
            out.append(ANY)
        elif "://" in name or "/" in name:
            issues.error(
                where, f"{entry!r} is not a host name; write the name alone, as gpu.example.com"
            )
        elif is_ip_literal(host_name(name)):
            out.append(host_name(name))  # an address is always allowed; harmless
        elif host_name(name) != name:
            issues.error(
                where,
                f"{entry!r} has a port; write the name alone "
                "(any port of an allowed name is accepted)",
            )
        elif not _NAME.fullmatch(name):
            issues.error(
                where,
                f"{entry!r} is not a host name; expected a name such as gpu.example.com, "
                "a leading dot for its subdomains (.example.com), or * for any",
            )
        else:
            out.append(name)
    return tuple(dict.fromkeys(out))


def resolve_allowed_origins(raw: RawConfig, issues: Issues) -> tuple[str, ...]:
    out: list[str] = []
    for i, entry in enumerate(raw.server.allowed_origins):
        text = entry.strip()
        if text == ANY:
            out.append(ANY)
            continue
        key = origin_key(text, default_scheme="") if "://" in text else None
        if key is None or key[0] not in ("http", "https"):
            issues.error(
                f"server.allowedOrigins[{i}]",
                f"{entry!r} is not an origin; expected scheme://host[:port] as a browser sends "
                "it in Origin (https://chat.example.com, http://localhost:3000), or * for any",
            )
            continue
        out.append(origin_text(key))
    return tuple(dict.fromkeys(out))


def origin_text(key: tuple[str, str, int]) -> str:
    """The origin as a browser writes it: the default port left out."""
    scheme, host, port = key
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" if port == _DEFAULT_PORTS[scheme] else f"{scheme}://{shown}:{port}"
