"""llama-swap's listing routes in its shapes, plus gpulane's own fields:
`/v1/models` and `/models`, `/running`, `/logs/stream` and its per-source
streams (`/logs/stream/proxy`, `/logs/stream/upstream`, `/logs/stream/MODEL`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import MediaType, Request, Response, get
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Stream

from app.config import Config, ModelConfig
from app.config.resolved import Capabilities
from app.runtime.log_buffer import LogBuffer, LogLine
from app.runtime.scheduler import Scheduler
from app.web.access import admin_only, identity, model_fields
from app.web.errors import error_body

OWNER = "gpulane"


def list_models(config: Config, scheduler: Scheduler) -> dict[str, Any]:
    """llama-swap's listing (`status.value`, `meta.llamaswap` with the model's
    metadata, `type` and `aliases`; with `includeAliasesInList`, one entry per
    alias of `type: alias`), plus gpulane's `state`. Sorted by id, as llama-swap."""
    created = int(time.time())
    data: list[dict[str, Any]] = []
    for spec in config.models.values():
        if spec.unlisted:
            continue
        state = scheduler.model_status(spec.id).state
        own: dict[str, Any] = {"type": "model"}
        if spec.aliases:
            own["aliases"] = list(spec.aliases)
        data.append(_record(spec.id, spec, state, own, created))
        if config.include_aliases_in_list:
            for alias in spec.aliases:
                if alias.strip():
                    own = {"type": "alias", "modelID": spec.id}
                    data.append(_record(alias, spec, state, own, created))
    data.sort(key=lambda entry: entry["id"])
    return {"object": "list", "data": data}


def _record(
    entry_id: str, spec: ModelConfig, state: str, own: dict[str, Any], created: int
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": entry_id,
        "object": "model",
        "created": created,
        "owned_by": OWNER,
    }
    if spec.name and spec.name.strip():
        entry["name"] = spec.name.strip()
    if spec.description and spec.description.strip():
        entry["description"] = spec.description.strip()
    caps = spec.capabilities
    metadata = spec.metadata
    if not caps.empty:
        entry.update(_rendered_capabilities(caps))
        # The capability fields are the renderer's: metadata keys of those names go.
        metadata = {k: v for k, v in metadata.items() if k not in _CAPABILITY_FIELDS}
    meta: dict[str, Any] = {"llamaswap": {**metadata, **own}}
    if caps.context > 0:
        meta["n_ctx"] = caps.context
    entry["meta"] = meta
    # llama-swap counts a starting or stopping model as loaded, as its running list does.
    entry["status"] = {"value": "unloaded" if state == "stopped" else "loaded"}
    entry["state"] = state  # gpulane's: starting | ready | stopping | sleeping | stopped
    return entry


_CAPABILITY_FIELDS = frozenset(
    {"architecture", "capabilities", "supported_parameters", "context_length"}
)


def _rendered_capabilities(caps: Capabilities) -> dict[str, Any]:
    """`capabilities` as llama-swap's /v1/models renders them (its renderCapabilities)."""
    out: dict[str, Any] = {}
    arch: dict[str, Any] = {}
    if caps.inputs:
        arch["input_modalities"] = list(caps.inputs)
    if caps.outputs:
        arch["output_modalities"] = list(caps.outputs)
    if caps.inputs and caps.outputs:
        arch["modality"] = "+".join(caps.inputs) + "->" + "+".join(caps.outputs)
    if arch:
        out["architecture"] = arch
    flags: dict[str, bool] = {}
    takes, gives = set(caps.inputs), set(caps.outputs)
    if "image" in takes:
        flags["vision"] = True
    if "audio" in takes and "text" in gives:
        flags["audio_transcriptions"] = True
    if "text" in takes and "audio" in gives:
        flags["audio_speech"] = True
    if "text" in takes and "image" in gives:
        flags["image_generation"] = True
    if "image" in takes and "image" in gives:
        flags["image_to_image"] = True
    if caps.tools:
        flags["function_calling"] = True
    if caps.reranker:
        flags["reranker"] = True
    if flags or caps.inputs or caps.outputs:
        out["capabilities"] = flags
    if caps.tools:
        out["supported_parameters"] = ["tools", "tool_choice"]
    if caps.context > 0:
        out["context_length"] = caps.context
    return out


def running_models(
    config: Config, scheduler: Scheduler, request: Request[Any, Any, Any]
) -> dict[str, Any]:
    """llama-swap's `/running` (model, state, cmd, proxy, ttl, name,
    description) plus gpulane's `pid` and `in_flight`; a user key never sees
    `cmd` or `proxy` (app/web/access.py)."""
    who = identity(request.scope)
    out = []
    # llama-swap lists every process that is not stopped: starting, ready, stopping.
    for model in sorted({*scheduler.loaded_models(), *scheduler.stopping_models()}):
        spec = config.models[model]
        status = scheduler.model_status(model)
        row = {
            "model": model,
            "state": status.state,
            "cmd": " ".join(spec.cmd),
            "proxy": spec.proxy,
            # llama-swap's ttl is whole seconds; gpulane's may be fractional.
            "ttl": int(spec.ttl) if float(spec.ttl).is_integer() else spec.ttl,
            "name": spec.name or "",
            "description": spec.description or "",
            "pid": status.pid,
            "in_flight": status.in_flight,
        }
        out.append(model_fields(who, row))
    return {"running": out}


def listing_routes(config: Config, scheduler: Scheduler) -> list[BaseRouteHandler]:
    @get(["/v1/models", "/models"], sync_to_thread=False)
    def models(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        # The Origin echoed, as llama-swap does, so a browser app may read the list.
        origin = request.headers.get("origin")
        headers = {"Access-Control-Allow-Origin": origin} if origin else None
        return Response(list_models(config, scheduler), headers=headers)

    @get("/running", sync_to_thread=False)
    def running(request: Request[Any, Any, Any]) -> dict[str, Any]:
        return running_models(config, scheduler, request)

    return [models, running]


# -- log streams -------------------------------------------------------------------


def log_routes(config: Config, logs: LogBuffer) -> list[BaseRouteHandler]:
    """`/logs/stream` (every line, `[source] text`) and `/logs/stream/NAME` (one
    source's text: `proxy`, `upstream` for every model's server, or a model id
    or alias, slashes included). Each first replays the lines held, as
    llama-swap does, unless the query has `no-history`; then follows new ones.
    Admin only, as `/logs` is."""

    @get("/logs/stream", sync_to_thread=False, guards=[admin_only])
    def stream_all(request: Request[Any, Any, Any]) -> Stream:
        return _stream(logs, request, lambda line: True, LogLine.format)

    @get("/logs/stream/{name:path}", sync_to_thread=False, guards=[admin_only])
    def stream_one(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[Any]:
        name = name.strip("/")
        keep: Callable[[LogLine], bool]
        if name == "proxy":
            keep = _source_is("proxy")
        elif name == "upstream":
            keep = _upstream_line
        else:
            model = config.resolve_model(name)
            if model is None:
                message = f"no log named {name!r}; use proxy, upstream or a model's id"
                return Response(
                    error_body(404, message, "not_found"),
                    status_code=404,
                    media_type=MediaType.JSON,
                )
            keep = _source_is(f"upstream:{model}")
        return _stream(logs, request, keep, _text)

    return [stream_all, stream_one]


def _source_is(source: str) -> Callable[[LogLine], bool]:
    return lambda line: line.source == source


def _upstream_line(line: LogLine) -> bool:
    return line.source.startswith("upstream:")


def _text(line: LogLine) -> str:
    return line.text


def _stream(
    logs: LogBuffer,
    request: Request[Any, Any, Any],
    keep: Callable[[LogLine], bool],
    show: Callable[[LogLine], str],
) -> Stream:
    # Subscribed before the response starts, the history in the same step, so
    # no line is missed or sent twice; the queue holds the whole history.
    held = 0 if "no-history" in request.query_params else len(logs)
    subscription = logs.subscribe(maxsize=held + 1000, backlog=held)

    async def lines() -> AsyncIterator[bytes]:
        async with subscription:  # unsubscribes when the client leaves
            async for line in subscription:
                if keep(line):
                    yield show(line).encode() + b"\n"

    return Stream(lines(), media_type=MediaType.TEXT, headers={"X-Accel-Buffering": "no"})
