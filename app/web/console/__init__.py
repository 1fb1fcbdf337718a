"""The web console at /ui/ (issue 14): page shells, static modules and the JSON they fetch.

See docs/ui.md. `console_routes` is what `gpulane serve` registers;
`gpulane ui --db FILE` (readonly.py) serves the same pages over a copied log.
"""

from __future__ import annotations

from litestar.handlers import BaseRouteHandler
from sqlalchemy import Engine

from app.web.console.data_routes import Live, data_routes
from app.web.console.pages import page_routes
from app.web.console.security import open_console_assets

__all__ = ["Live", "console_routes", "open_console_assets"]


def console_routes(engine: Engine | None, live: Live | None) -> list[BaseRouteHandler]:
    return [*page_routes(), *data_routes(engine, live)]
