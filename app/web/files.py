"""The OpenAI Files API (`/v1/files`), the first door of the Batch API.

Files are stored whole in the database (app/store/files.py), in one
transaction, owned by the caller that uploaded them: a user key sees, fetches
and deletes only its own; another caller's file answers 404 as if it did not
exist (app/web/access.py). An upload larger than `jobs.maxFileBytes` is
refused with 413 naming that key, before it is read whole.

`POST` and `GET /v1/files` share one raw ASGI route (the upload is read as it
arrives, to stop at the limit); the other routes are plain Litestar handlers.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl

import msgspec
from litestar import Request, Response, asgi, delete, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.types import Receive, Scope, Send
from sqlalchemy import Engine, RowMapping

from app.config import Config
from app.jobs.reserve import disk_shortfall
from app.store.files import delete_file, file_content, file_meta, file_row, list_files, store_file
from app.web.access import identity, may_see, only_caller
from app.web.auth import identify
from app.web.errors import error_response, send_error, send_json
from app.web.request_body import BadRequest, read_body

UPLOAD_PURPOSES = ("batch", "user_data", "assistants", "vision", "fine-tune", "evals")
"""What a caller may upload a file for; `batch_output` files are gpulane's own."""

_ENVELOPE = 64 * 1024
"""Bytes of multipart framing (boundaries, part headers, `purpose`) allowed
beyond `jobs.maxFileBytes` before the upload is cut off."""


def file_object(row: RowMapping | dict[str, Any]) -> dict[str, Any]:
    """A stored file in OpenAI's shape."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": int(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def not_found(file_id: str) -> Response[bytes]:
    return error_response(404, f"no file {file_id}", "file_not_found")


class FileStore:
    def __init__(self, config: Config, engine: Engine) -> None:
        self.config = config
        self.engine = engine

    async def owned(self, request: Request[Any, Any, Any], file_id: str) -> RowMapping | None:
        """The file's metadata, or None if there is none or it is not the caller's."""
        row = await asyncio.to_thread(file_meta, self.engine, file_id)
        if row is None or not may_see(identity(request.scope), row["caller"]):
            return None
        return row

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = str(scope.get("method", "GET"))
        if method == "POST":
            await self._upload(scope, receive, send)
        elif method == "GET":
            await self._list(scope, send)
        else:
            await send_error(
                send,
                405,
                f"method {method} is not allowed on /v1/files; allowed: GET, POST",
                code="method_not_allowed",
                headers=[(b"allow", b"GET, POST")],
            )

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        limit = self.config.max_file_bytes
        try:
            who = identify(scope, headers)
            body = await _read_limited(receive, headers, limit)
            fields = parse_multipart(body, headers.get("content-type", ""))
            purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
            if "file" not in fields:
                raise BadRequest(400, "missing the 'file' part of the form", "missing_file")
            filename, content = fields["file"]
            if len(content) > limit:
                raise BadRequest(413, _too_large(limit), "file_too_large")
            if purpose not in UPLOAD_PURPOSES:
                raise BadRequest(
                    400,
                    f"purpose {purpose!r} is not one of {', '.join(UPLOAD_PURPOSES)}",
                    "invalid_purpose",
                )
        except BadRequest as exc:
            await send_error(send, exc.status, exc.message, code=exc.code, param=exc.param)
            return
        except ConnectionError:
            return
        short = disk_shortfall(
            self.engine, self.config.min_free_disk, len(content), "this file: its content"
        )
        if short is not None:
            await send_error(send, 507, short, code="insufficient_storage")
            return
        row = file_row(who.caller, purpose, filename or "upload", content)
        await asyncio.to_thread(store_file, self.engine, row)
        await send_json(send, 200, msgspec.json.encode(file_object(row)))

    async def _list(self, scope: Scope, send: Send) -> None:
        query = _query(scope)
        try:
            limit = max(1, min(int(query.get("limit", "10000")), 10000))
        except ValueError:
            message = "limit must be an integer (1 to 10000)"
            await send_error(send, 400, message, code="invalid_limit", param="limit")
            return
        order = query.get("order", "desc")
        caller = only_caller(identity(scope))
        rows, more = await asyncio.to_thread(
            list_files,
            self.engine,
            caller,
            query.get("purpose"),
            limit,
            query.get("after"),
            order != "asc",
        )
        data = [file_object(r) for r in rows]
        page = {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
        await send_json(send, 200, msgspec.json.encode(page))


def file_routes(store: FileStore) -> list[BaseRouteHandler]:
    @get("/v1/files/{file_id:str}")
    async def retrieve(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
        row = await store.owned(request, file_id)
        if row is None:
            return not_found(file_id)
        return Response(file_object(row))

    @get("/v1/files/{file_id:str}/content")
    async def content(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
        if await store.owned(request, file_id) is None:
            return not_found(file_id)
        found = await asyncio.to_thread(file_content, store.engine, file_id)
        if found is None:
            return not_found(file_id)
        return Response(found[1], media_type="application/octet-stream")

    @delete("/v1/files/{file_id:str}", status_code=200)
    async def remove(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
        if await store.owned(request, file_id) is None:
            return not_found(file_id)
        deleted = await asyncio.to_thread(delete_file, store.engine, file_id)
        return Response({"id": file_id, "object": "file", "deleted": deleted})

    upload_or_list = asgi(path="/v1/files", is_mount=False, copy_scope=False)(store.asgi)
    return [upload_or_list, retrieve, content, remove]


def _too_large(limit: int) -> str:
    return f"file is larger than the limit of {limit} bytes (jobs.maxFileBytes)"


async def _read_limited(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The upload's body; 413 naming jobs.maxFileBytes as soon as it cannot fit."""
    cap = limit + _ENVELOPE

    def too_large() -> BadRequest:
        return BadRequest(413, _too_large(limit), "file_too_large")

    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large()
    return await read_body(receive, cap, too_large)


def parse_multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data body: name -> (filename, content)."""
    boundary = None
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip().strip('"')
    if not content_type.lower().startswith("multipart/form-data") or not boundary:
        raise BadRequest(
            400,
            "expected a multipart/form-data body with 'purpose' and 'file' parts",
            "invalid_form",
        )
    delimiter = b"--" + boundary.encode("latin-1")
    out: dict[str, tuple[str | None, bytes]] = {}
    pieces = body.split(b"\r\n" + delimiter)
    # The first piece starts with the delimiter itself (no CRLF before it).
    first = pieces[0]
    if not first.startswith(delimiter):
        raise BadRequest(400, "the multipart body does not start with its boundary", "invalid_form")
    pieces[0] = first[len(delimiter) :]
    for piece in pieces:
        if piece.startswith(b"--"):
            break  # the closing delimiter
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise BadRequest(400, "a multipart part has no header end", "invalid_form")
        name = filename = None
        for line in head.split(b"\r\n"):
            key, _, value = line.decode("utf-8", "replace").partition(":")
            if key.strip().lower() == "content-disposition":
                params = _disposition(value)
                name, filename = params.get("name"), params.get("filename")
        if name is not None and name not in out:
            out[name] = (filename, content)
    return out


def _disposition(value: str) -> dict[str, str]:
    params = {}
    for item in value.split(";")[1:]:
        key, _, val = item.strip().partition("=")
        params[key.strip().lower()] = val.strip().strip('"')
    return params


def _query(scope: Scope) -> dict[str, str]:
    raw: bytes = scope.get("query_string", b"")
    return dict(parse_qsl(raw.decode("latin-1")))
