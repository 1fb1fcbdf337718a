"""Prometheus metrics, fed by the events the scheduler emits.

Counters and histograms are updated as events happen; queue depth and oldest
wait are read from the scheduler state at scrape time so they are never stale.
Per-caller series exist only for the labels of the configured `apiKeys`: a
bounded set. A free-form `X-Gpulane-Caller` never becomes a label value, so no
client can grow the number of series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.core import events as ev
from app.core.policy import reorder_reasons
from app.core.priority import band_of
from app.core.scoring import NS_PER_S
from app.core.state import SchedulerState
from app.core.wait import wait_ns
from app.runtime.gpu import GpuMemory
from app.runtime.gpu_metrics import GpuCollector

BANDS = ("interactive", "normal", "batch")
_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 14400)


class _QueueCollector(Collector):
    def __init__(
        self,
        state: Callable[[], SchedulerState],
        clock: Callable[[], int],
        callers: tuple[str, ...],
    ) -> None:
        self._state = state
        self._clock = clock
        self._callers = callers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state()
        now = self._clock()
        depth: dict[str, int] = dict.fromkeys(BANDS, 0)
        oldest: dict[str, float] = dict.fromkeys(BANDS, 0.0)
        by_caller: dict[str, int] = dict.fromkeys(self._callers, 0)
        for q in state.queue:
            request = state.requests[q.request_id]
            band = band_of(request.priority)
            depth[band] += 1
            oldest[band] = max(oldest[band], wait_ns(q.enqueued_ns, None, now) / NS_PER_S)
            if request.caller in by_caller:
                by_caller[request.caller] += 1
        g_depth = GaugeMetricFamily(
            "llamaswap_scheduler_queue_depth", "Requests waiting, by band", labels=["band"]
        )
        g_oldest = GaugeMetricFamily(
            "llamaswap_scheduler_queue_oldest_wait_seconds",
            "Wait so far of the oldest waiting request, by band",
            labels=["band"],
        )
        for label in BANDS:
            g_depth.add_metric([label], depth[label])
            g_oldest.add_metric([label], oldest[label])
        yield g_depth
        yield g_oldest
        g_used = GaugeMetricFamily(
            "gpulane_model_slots_in_use",
            "Requests running on the model now (loading included), of its slots",
            labels=["model"],
        )
        g_slots = GaugeMetricFamily(
            "gpulane_model_slots",
            "The model's slots: requests it may run at once (concurrencyLimit)",
            labels=["model"],
        )
        for model in sorted(set(state.concurrency) | set(state.running.values())):
            g_used.add_metric([model], state.running_on(model))
            g_slots.add_metric([model], state.slots(model))
        yield g_used
        yield g_slots
        if self._callers:
            g_caller = GaugeMetricFamily(
                "gpulane_caller_queue_depth",
                "Requests waiting, by caller (API key label)",
                labels=["caller"],
            )
            for caller, count in by_caller.items():
                g_caller.add_metric([caller], count)
            yield g_caller


class Metrics:
    def __init__(
        self,
        state: Callable[[], SchedulerState],
        clock: Callable[[], int],
        *,
        callers: tuple[str, ...] = (),
    ) -> None:
        """`callers`: the API key labels, the only caller label values."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._callers = frozenset(callers)
        self.dispatched = Counter(
            "llamaswap_scheduler_dispatched", "Requests dispatched, by band", ["band"], registry=r
        )
        self.reorders = Counter(
            "llamaswap_scheduler_reorders",
            "Dispatches where a score term changed the pick",
            ["band", "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "gpulane_queue_wait_seconds",
            "Wait of each request once it is over (app/core/wait.py): arrival to "
            "dispatch, or to its end for one never dispatched, by band",
            ["band"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.priority_ignored = Counter(
            "gpulane_priority_ignored",
            "Requests whose X-LlamaSwap-Priority could not be read: run as if they asked "
            "for none, and told so (X-Gpulane-Priority-Requested, -Warning)",
            registry=r,
        )
        self.swaps = Counter(
            "gpulane_swaps", "Model swaps, by model and outcome", ["model", "outcome"], registry=r
        )
        self.swap_seconds = Histogram(
            "gpulane_swap_duration_seconds",
            "Time to load a model (start to healthy), by model",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.loads = Counter(
            "gpulane_loads",
            "Model loads begun, by model and reason (request: for a waiting request; "
            "preload: hooks.on_startup.preload)",
            ["model", "reason"],
            registry=r,
        )
        self.stops = Counter(
            "gpulane_model_stops",
            "Model servers stopped, by model and reason (evicted: for another model's "
            "load; ttl, unload, hung, crashed, failed_start, shutdown, recovered)",
            ["model", "reason"],
            registry=r,
        )
        self.upstream_up = Gauge(
            "gpulane_upstream_up",
            "1 while the model's upstream process runs",
            ["model"],
            registry=r,
        )
        self.finished = Counter(
            "gpulane_requests_finished",
            "Requests that ended, by band and status",
            ["band", "status"],
            registry=r,
        )
        # Without apiKeys there is no bounded set of callers: no per-caller series.
        by_caller = r if callers else None
        self.rejected = Counter(
            "gpulane_requests_rejected",
            "Requests refused (at admission, or a passed X-Gpulane-Max-Wait), by reason",
            ["reason"],
            registry=r,
        )
        self.caller_requests = Counter(
            "gpulane_caller_requests",
            "Requests admitted to the queue, by caller (API key label)",
            ["caller"],
            registry=by_caller,
        )
        self.caller_lowered = Counter(
            "gpulane_caller_priority_lowered",
            "Requests that asked for more than their key's maxPriority, by caller",
            ["caller"],
            registry=by_caller,
        )
        for caller in callers:  # present at 0 before the first request
            self.caller_requests.labels(caller)
            self.caller_lowered.labels(caller)
        r.register(_QueueCollector(state, clock, callers))
        self._queued: dict[str, tuple[str, int]] = {}
        """request id -> (band, arrival ns) while its attempt waits: a request that
        ends without a dispatch has its wait observed at its end."""

    def observe(self, event: ev.AnyEvent, state: SchedulerState) -> None:
        """Called for every event after it is applied to `state`."""
        match event:
            case ev.RequestEnqueued():
                self._queue(event, state)
                if event.attempt == 1:
                    self._admitted(event)
            case ev.RequestRequeued() | ev.RequestRestored():
                self._queue(event, state)
            case ev.ScoresComputed():
                band = band_of(event.winner.priority)
                self.dispatched.labels(band).inc()
                for reason in reorder_reasons(event):
                    self.reorders.labels(band, reason).inc()
            case ev.RequestDispatched():
                queued = self._queued.pop(event.request_id, None)
                if queued is not None:
                    self._observe_wait(queued, event.at, event.at)
            case ev.RequestCompleted() | ev.RequestFailed() | ev.RequestAbandoned():
                self._ended_queued(event.request_id, event.at)
            case ev.RequestCancelled():
                self._ended_queued(event.request_id, event.at)
                if event.reason == "deadline":
                    self.rejected.labels("deadline").inc()
            case ev.RequestRejected():
                self.rejected.labels(event.reason or "invalid_request").inc()
            case ev.SwapFinished():
                self.swaps.labels(event.model, "ok").inc()
                self.swap_seconds.labels(event.model).observe(event.duration_ms / 1000)
            case ev.SwapFailed():
                self.swaps.labels(event.model, "failed").inc()
            case ev.SwapStarted():
                reason = "preload" if event.request_id is None else "request"
                self.loads.labels(event.to_model, reason).inc()
            case ev.ProcessStarted():
                self.upstream_up.labels(event.model).set(1)
            case ev.ProcessStopped():
                self.upstream_up.labels(event.model).set(0)
                self.stops.labels(event.model, event.reason).inc()
            case _:
                pass

    def _admitted(self, event: ev.RequestEnqueued) -> None:
        """A request's first enqueue."""
        if event.priority_ignored is not None:
            self.priority_ignored.inc()
        if event.caller in self._callers:
            self.caller_requests.labels(event.caller).inc()
            asked = event.requested_priority
            if asked is not None and asked > event.priority:
                self.caller_lowered.labels(event.caller).inc()

    def _queue(self, event: ev.AnyEvent, state: SchedulerState) -> None:
        if isinstance(event, ev.RequestEnqueued):
            arrived = event.enqueued_at if event.enqueued_at is not None else event.at
            self._queued[event.request_id] = (band_of(event.priority), arrived)
            return
        request_id = ev.request_id_of(event)
        request = None if request_id is None else state.requests.get(request_id)
        if request is not None:
            self._queued[request.request_id] = (band_of(request.priority), request.enqueued_ns)

    def _ended_queued(self, request_id: str, at: int) -> None:
        queued = self._queued.pop(request_id, None)
        if queued is not None:  # never dispatched: it waited until its end
            self._observe_wait(queued, None, at)

    def _observe_wait(self, queued: tuple[str, int], dispatched: int | None, until: int) -> None:
        band, arrived = queued
        self.queue_wait.labels(band).observe(max(0, wait_ns(arrived, dispatched, until)) / NS_PER_S)

    def observe_finish(self, band: str, status: str) -> None:
        self.finished.labels(band, status).inc()

    def watch_gpu(self, memory: GpuMemory, footprints: Callable[[], Mapping[str, int]]) -> None:
        """Add the GPU's gauges and each model's footprint (app/runtime/gpu_metrics.py)."""
        self.registry.register(GpuCollector(memory, footprints))
