"""The console's page shells and static files, served from app/web/console/static/.

Every page path answers the same shell (static/shell.html); static/main.js
reads the path and draws the page from JSON. Static files are read once at
start and served from memory by name, so no request path reaches the disk.
"""

from __future__ import annotations

from pathlib import Path

from litestar import MediaType, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Redirect

from app.web.console.security import PAGES, SECURITY_HEADERS
from app.web.errors import error_body

STATIC_DIR = Path(__file__).parent / "static"
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _static_files() -> dict[str, tuple[bytes, str]]:
    return {
        p.name: (p.read_bytes(), _TYPES[p.suffix])
        for p in sorted(STATIC_DIR.iterdir())
        if p.suffix in _TYPES
    }


def page_routes() -> list[BaseRouteHandler]:
    shell = (STATIC_DIR / "shell.html").read_bytes()
    files = _static_files()
    # A page is the same for everyone: the browser may keep it, but must ask again
    # (a new gpulane version ships new scripts under the same names).
    cache = {"Cache-Control": "no-cache"}

    @get("/", sync_to_thread=False, include_in_schema=False)
    def root() -> Redirect:
        return Redirect("/ui/")

    @get(
        [
            *PAGES,
            "/ui/requests/{request_id:str}",
            "/ui/batches/{batch_id:str}",
            "/ui/chains/{chain_id:str}",
        ],
        sync_to_thread=False,
        include_in_schema=False,
        response_headers=SECURITY_HEADERS,
    )
    def page() -> Response[bytes]:
        return Response(shell, media_type=MediaType.HTML, headers=cache)

    @get(
        "/ui/static/{name:str}",
        sync_to_thread=False,
        include_in_schema=False,
        response_headers=SECURITY_HEADERS,
    )
    def static(name: FromPath[str]) -> Response[bytes]:
        found = files.get(name)
        if found is None:
            return Response(
                error_body(404, f"no console file {name!r}", "not_found"),
                status_code=404,
                media_type=MediaType.JSON,
            )
        body, media_type = found
        return Response(body, media_type=media_type, headers=cache)

    return [root, page, static]
