"""What the web layer and the run loop exchange: the values web hands the
scheduler (`Admission`), the handle it gets back (`Ticket`), what the
scheduler tells a serving task (`Detached`) and the read-only views web reads
(`OpenStatus`, `ModelStatus`, `LiveState`). Web imports these and calls
`Scheduler`'s methods; it reads no scheduler field.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from app.core import events as ev
from app.core.priority import band_of, priority_warning
from app.core.scoring import Breakdown
from app.core.state import SchedulerState

SHUTTING_DOWN = "gpulane is shutting down; retry in a moment"


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """What the web layer knows about a request when it asks for a place in the queue."""

    model: str
    model_requested: str
    endpoint: str
    priority: int
    """Granted: what the request queues at."""
    requested_priority: int | None = None
    """What it asked for (header, else service_tier); None: nothing."""
    priority_unreadable: str | None = None
    """Its priority header as sent, when it could not be read
    (`core.priority.unreadable_priority`)."""
    caller: str | None = None
    durable: bool = False
    idempotency_key: str | None = None
    job: dict[str, Any] | None = None
    max_wait_ns: int | None = None
    """The longest the caller will wait in the queue (`X-Gpulane-Max-Wait`)."""
    chain: str | None = None
    """`X-Gpulane-Chain`: the caller's run this request belongs to."""
    chain_length: int | None = None
    """`X-Gpulane-Chain-Length`: how many requests that run has."""
    request_id: str | None = None
    """Chosen by the caller (a durable job's body is stored under it first); else new."""

    def enqueued(self, at: int, request_id: str, expected_run_ns: int | None) -> ev.RequestEnqueued:
        """Its `request_enqueued`: what the log keeps of it, once admitted."""
        return ev.RequestEnqueued(
            at=at,
            request_id=request_id,
            model=self.model,
            model_requested=self.model_requested,
            endpoint=self.endpoint,
            priority=self.priority,
            requested_priority=self.requested_priority,
            priority_ignored=(
                None
                if self.priority_unreadable is None
                else priority_warning(self.priority_unreadable)
            ),
            priority_unreadable=self.priority_unreadable,
            band=band_of(self.priority),
            durable=self.durable,
            caller=self.caller,
            idempotency_key=self.idempotency_key,
            job=self.job,
            expected_run_ns=expected_run_ns,
            max_wait_ns=self.max_wait_ns,
            chain=self.chain,
            chain_length=self.chain_length,
        )


class OpenStatus(msgspec.Struct, frozen=True):
    """What the live state says of a request that is queued or running."""

    status: Literal["queued", "running"]
    attempt: int
    score: Breakdown | None = None
    """Its score's terms as of now, while it waits."""


class LiveState(msgspec.Struct, frozen=True):
    """What reports read of the run loop, as of `now_ns`. Read-only: only the
    scheduler changes its state, and only through events."""

    state: SchedulerState
    running_since: Mapping[str, int]
    """request id -> unix ns of its dispatch, for what is running."""
    now_ns: int


class ModelStatus(msgspec.Struct, frozen=True):
    state: Literal["starting", "ready", "stopping", "sleeping", "stopped"]
    """llama-swap's words: a process being stopped is `stopping`; gpulane's
    `sleeping`: its process runs, put to sleep (its `sleep` config)."""
    pid: int | None
    in_flight: int


class Detached(msgspec.Struct, frozen=True):
    """Why the scheduler took a request away from the task serving it, and what
    that task should answer its client (OpenAI error shape)."""

    status: int
    code: str
    message: str
    retry_after: int | None = None
    """Seconds, sent as `Retry-After`."""


class Ticket:
    """A caller's handle on its request: resolves to the upstream's base URL when it may run."""

    __slots__ = (
        "request_id",
        "model",
        "endpoint",
        "band",
        "priority",
        "enqueued_ns",
        "ready",
        "committed",
        "score",
        "queue_wait_ms",
        "time_to_start_ms",
        "detached",
        "job",
    )

    def __init__(
        self, request_id: str, model: str, priority: int, enqueued_ns: int, endpoint: str = ""
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.endpoint = endpoint
        self.priority = priority
        self.band = band_of(priority)
        self.enqueued_ns = enqueued_ns
        self.ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.committed: asyncio.Future[list[int]] | None = None
        """Resolves when the enqueue is on disk (durable jobs wait for it)."""
        self.score: float | None = None
        self.queue_wait_ms: float | None = None
        self.time_to_start_ms: float | None = None
        """Arrival to its start, its load included (`core.wait.time_to_start_ns`)."""
        self.detached: asyncio.Future[Detached] = asyncio.get_running_loop().create_future()
        """Set when the scheduler ends or re-queues the request on its own
        (time limit, operator, shutdown): the serving task stops and answers this."""
        self.job: Any = None
        """The durable job this ticket sends (`Jobs.run` sets it): sent again on a
        fresh ticket if an unload puts the job back while it runs."""


def new_request_id() -> str:
    return uuid.uuid4().hex
