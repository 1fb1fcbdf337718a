"""Loading a peer's model: there is no process, only the question whether the
peer answers.

A peer's model entry (`app.config.peers`) is "loaded" by one `GET /v1/models`
to the peer (every OpenAI-compatible server, llama-swap and gpulane answer it),
with the peer's key. Any HTTP answer means the peer is there (a 401 will show
in the requests themselves); no answer within `timeouts.connect` is a failed
load, recorded as `swap_failed` with the reason, so the requests waiting on it
fail (or go to another peer) with a clear error and the queue moves on.
"""

from __future__ import annotations

from typing import Final

import httpx

from app.config import ModelConfig
from app.runtime.upstream import UpstreamStartError

PROBE_PATH: Final = "/v1/models"
DEFAULT_PROBE_TIMEOUT: Final = 10.0


async def probe(spec: ModelConfig) -> None:
    """Raise UpstreamStartError when the peer behind `spec` does not answer."""
    limit = spec.connect_timeout or DEFAULT_PROBE_TIMEOUT
    url = spec.proxy + PROBE_PATH
    try:
        async with httpx.AsyncClient(timeout=limit) as client:
            await client.get(url, headers=spec.headers)
    except httpx.HTTPError as exc:
        raise UpstreamStartError(
            f"peer {spec.peer!r} at {spec.proxy} did not answer GET {PROBE_PATH} "
            f"within {limit:g} s: {type(exc).__name__}: {exc}".rstrip(": ")
        ) from exc
