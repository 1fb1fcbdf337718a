"""Who may see and do what (issues 12 and 21, isolation), in one place for every route.

Without `apiKeys` everyone is an admin (as in llama-swap). With them, a `user`
key sees, fetches, cancels and lists only its own requests and jobs; another
caller's answers 404, as if it did not exist, so ids cannot be probed. Where a
report of its own request needs another caller's work (what ran, what won, what
swapped), it is "another caller's request", with no id or label
(app/report/visibility.py, given `only_caller`). A model's `cmd`, `env` and
`proxy` are the operator's (`ADMIN_ONLY_FIELDS`). What concerns the whole
server needs an `admin` key (`admin_only`): unloading models, the logs, the
metrics (every caller's counts), and `/upstream/` (an upstream's own pages, such
as llama-server's `/slots` and `/metrics`, show every caller's work, and gpulane
cannot filter them).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers import BaseRouteHandler
from litestar.types import ExceptionHandlersMap, Scope

from app.web.auth import ANONYMOUS, Identity
from app.web.errors import error_response

ADMIN_KEY_REQUIRED = "admin_key_required"


def identity(scope: Scope) -> Identity:
    """What the key middleware found; without apiKeys, anonymous (an admin)."""
    found = scope.get("state", {}).get("identity")
    return found if isinstance(found, Identity) else ANONYMOUS


def is_admin(who: Identity) -> bool:
    return who.role == "admin"


def only_caller(who: Identity) -> str | None:
    """The caller whose rows `who` may list; None: everyone's. A user key always
    has a label (its own or key#N), so None never means "the anonymous rows"."""
    return None if is_admin(who) else who.caller


def may_see(who: Identity, row_caller: str | None) -> bool:
    return is_admin(who) or (who.caller is not None and who.caller == row_caller)


ADMIN_ONLY_FIELDS = frozenset({"cmd", "env", "proxy"})
"""A model's settings that may hold a secret (a token in `cmd` or `env`, a
password in a proxy URL): shown to an admin key only."""


def model_fields(who: Identity, row: dict[str, Any]) -> dict[str, Any]:
    """A row describing a model, less `ADMIN_ONLY_FIELDS` for a user key."""
    if is_admin(who):
        return row
    return {k: v for k, v in row.items() if k not in ADMIN_ONLY_FIELDS}


class AdminKeyRequired(HTTPException):
    status_code = 403


def admin_only(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A Litestar guard: a user key gets 403 `admin_key_required`."""
    if not is_admin(identity(connection.scope)):
        # raw_path: a mount (/upstream) sees only the rest of the path in `path`.
        raw = connection.scope.get("raw_path")
        path = raw.decode("latin-1") if raw else connection.url.path
        where = f"{connection.scope.get('method', 'GET')} {path}"
        raise AdminKeyRequired(detail=f"{where} needs an admin API key; this key's role is user")


def _forbidden(_: Request[Any, Any, Any], exc: AdminKeyRequired) -> Response[bytes]:
    return error_response(403, exc.detail, ADMIN_KEY_REQUIRED, kind="permission_error")


ACCESS_HANDLERS: ExceptionHandlersMap = {AdminKeyRequired: _forbidden}
"""For `Litestar(exception_handlers=...)`, beside errors.EXCEPTION_HANDLERS."""
