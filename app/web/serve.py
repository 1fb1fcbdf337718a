"""`gpulane serve`: open the log, take the lease (or wait for it as a standby),
recover, start the run loop and the HTTP server."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from types import FrameType
from typing import Literal

import uvicorn
import uvloop
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp
from sqlalchemy import Engine

from app import __version__
from app.config import Config, ConfigError, load_config
from app.config.commands import missing_programs
from app.core.lane_history import DAYS
from app.core.scoring import NS_PER_S
from app.jobs.batches import Batches
from app.jobs.chain_progress import ChainProgress
from app.jobs.durable import Jobs
from app.runtime import gpu_file
from app.runtime.gpu import GpuMemory, footprints
from app.runtime.gpu_nvml import open_nvml
from app.runtime.leadership import Leadership
from app.runtime.log_buffer import LogBuffer
from app.runtime.memory_history import with_history
from app.runtime.parameters import server_started
from app.runtime.recovery import recover
from app.runtime.reload import ConfigSource
from app.runtime.scheduler import Scheduler
from app.store.engine import DatabaseError, open_database, refused_by_disk, shown
from app.store.event_store import SqlEventStore
from app.store.footprints import recent_footprints
from app.store.lease import LeaseHeld, this_process
from app.store.queries import activity
from app.store.samples import lane_samples, recent_runs, recent_samples
from app.web.access_log import access_log
from app.web.admin_routes import admin_routes
from app.web.app import create_app
from app.web.batches import batch_routes, line_encoder
from app.web.chains import chain_routes
from app.web.comfyui_routes import comfyui_routes, open_renders
from app.web.console.batch_lines import batch_line_routes
from app.web.files import FileStore, file_routes
from app.web.forward import Forwarder
from app.web.jobs import JobDoor, JobRunner, job_routes
from app.web.limits import server_options
from app.web.log_wait import LogWait, open_when_disk_allows
from app.web.proxy import Proxy
from app.web.report_routes import report_routes
from app.web.responses import response_routes
from app.web.standby import StandbyGate, standby_text
from app.web.videos_routes import open_videos, videos_routes

log = logging.getLogger("gpulane")

RECENT_RUNS = 5000
"""Completed requests read at start to seed the expected run times."""
RECENT_LOADS = 500
"""Successful loads read at start to seed each model's load time (the estimates)."""

FENCED_EXIT = 3
"""Exit status of a server whose lease another gpulane took over (app/runtime/leadership.py)."""


def serve_command(
    config_path: str,
    listen: str,
    db: str | None,
    tls: tuple[str | None, str | None] = (None, None),
    *,
    watch: bool = False,
    standby: bool = False,
) -> int:
    try:
        config = load_config(config_path)
    except (ConfigError, OSError) as exc:
        print(f"gpulane: config {config_path}: {exc}", file=sys.stderr)
        return 2
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isdigit():
        print(f"gpulane: --listen must be HOST:PORT or :PORT, not {listen!r}", file=sys.stderr)
        return 2
    # `:PORT` is every interface, as in llama-swap (Go); `[::1]:PORT` is IPv6.
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    cert, key = tls
    if bool(cert) != bool(key):
        print("gpulane: TLS needs both --tls-cert-file and --tls-key-file", file=sys.stderr)
        return 2
    for path in (cert, key):
        if path and not os.access(path, os.R_OK):
            print(f"gpulane: TLS file {path!r} cannot be read", file=sys.stderr)
            return 2
    logging.basicConfig(
        level={"debug": logging.DEBUG, "warn": logging.WARNING, "error": logging.ERROR}.get(
            config.log_level, logging.INFO
        ),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Per-request and per-migration lines would drown the scheduler's own.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    for warning in config.warnings:
        log.warning("config: %s", warning)
    for model, why in missing_programs(config).items():
        log.warning("config: models.%s.cmd: %s", model, why)
    db_path = db or config.database_path
    try:
        engine, leadership, held = open_log(config, db_path, listen)
    except DatabaseError as exc:
        if not refused_by_disk(exc):
            print(f"gpulane: {exc}", file=sys.stderr)
            return 1
        # A full disk: listen and say why meanwhile, as a running server does, and
        # start once the log opens (app/web/log_wait.py).
        wait = _wait_then_serve(
            config, db_path, listen, (host, int(port)), tls, exc, watch=watch, standby=standby
        )
        try:
            return uvloop.run(wait)
        except KeyboardInterrupt:
            return 0
    if held is not None and not _standing_by(engine, leadership, held, standby):
        return 1
    try:
        uvloop.run(_serve(config, engine, host, int(port), leadership, tls, watch=watch))
    except KeyboardInterrupt:
        pass
    return 0


def open_log(
    config: Config, db_path: str, listen: str
) -> tuple[Engine, Leadership, LeaseHeld | None]:
    """Open the log and take its lease: (engine, leadership, why another holds
    the lease or None). Raises DatabaseError, having closed what it opened."""
    engine = open_database(db_path, synchronous=config.database_synchronous)  # type: ignore[arg-type]
    # One log, one leader: before recovery touches anything (app/store/lease.py).
    leadership = Leadership(engine, this_process(engine, listen), ttl=config.database_lease_s)
    try:
        leadership.take()
    except LeaseHeld as exc:
        return engine, leadership, exc
    except DatabaseError:
        engine.dispose()
        raise
    return engine, leadership, None


def _standing_by(engine: Engine, leadership: Leadership, held: LeaseHeld, standby: bool) -> bool:
    """Another gpulane leads: a standby waits for it (True); any other start
    says who leads and stops (False)."""
    if not standby:
        engine.dispose()
        print(f"gpulane: {held}", file=sys.stderr)
        return False
    log.info("%s", standby_text(leadership))
    return True


async def _wait_then_serve(
    config: Config,
    db_path: str,
    listen: str,
    address: tuple[str, int],
    tls: tuple[str | None, str | None],
    why: DatabaseError,
    *,
    watch: bool,
    standby: bool,
) -> int:
    """Serve `LogWait`'s answers on the listening socket until the log opens,
    then serve as usual on that same socket; the exit status."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        print(f"gpulane: cannot listen on {listen}: {exc}", file=sys.stderr)
        return 1
    gate = LogWait(db_path, why)
    log.warning("%s; listening on %s meanwhile", gate.text(), listen)
    # SIGHUP (a reload, a closed terminal) never ends the server; nothing to reload yet.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, log.info, "SIGHUP ignored until the event log opens"
    )
    waiting = _Server(_nothing, _uvicorn_config(config, gate, address, tls, lifespan="off"))

    def stop() -> None:
        waiting.should_exit = True

    opening = asyncio.get_running_loop().create_task(
        open_when_disk_allows(gate, partial(open_log, config, db_path, listen), stop)
    )
    # uvicorn closes the sockets it is given when it stops: it gets a duplicate,
    # and the socket itself, still listening, goes to the server that follows.
    await waiting.serve(sockets=[sock.dup()])
    if not opening.done():
        opening.cancel()  # stopped (SIGTERM, Ctrl-C) while waiting
        sock.close()
        return 0
    try:
        engine, leadership, held = opening.result()
    except DatabaseError as exc:
        sock.close()
        print(f"gpulane: {exc}", file=sys.stderr)
        return 1
    if waiting.stop_asked:  # a signal came as the log opened
        await leadership.release()
        engine.dispose()
        sock.close()
        return 0
    if held is not None and not _standing_by(engine, leadership, held, standby):
        sock.close()
        return 1
    await _serve(config, engine, host, port, leadership, tls, watch=watch, sockets=[sock])
    return 0


async def _nothing() -> None:
    """What the waiting server drains: nothing was admitted."""


def _video_dir(engine: Engine) -> str:
    """Where finished videos' content is kept without `jobs.videoDir`: beside a
    SQLite database (`gpulane.db-videos`), else `gpulane-videos` here."""
    if engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
        return os.path.abspath(engine.url.database or "") + "-videos"
    return os.path.abspath("gpulane-videos")


def _database_name(engine: Engine) -> str:
    """The database, named the same by every server of it: a file's absolute
    path, or a server's URL without the password."""
    if engine.dialect.name == "sqlite":
        return os.path.abspath(engine.url.database or "")
    return shown(engine.url)


async def _serve(
    config: Config,
    engine: Engine,
    host: str,
    port: int,
    leadership: Leadership,
    tls: tuple[str | None, str | None] = (None, None),
    *,
    watch: bool = False,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Serve until stopped; on `sockets` when given (already bound), else on host:port."""
    logs = LogBuffer()
    _capture_logs(logs)
    # Every append is fenced by this process's term; a standby's by none.
    store = SqlEventStore(engine, fence=leadership.fence)
    store.start()
    # Names this database in the upstreams' environment, so the next start's
    # recovery finds what they left, and never another server's.
    owner = hashlib.sha256(os.fsencode(_database_name(engine))).hexdigest()
    scheduler = Scheduler(config, store, logs=logs, owner=owner[:16])
    # NVML; none without a driver (one log line, nothing else changes); a fake GPU
    # shared by files when GPULANE_FAKE_GPU names one (tests, demos).
    gpu = GpuMemory(gpu_file.from_environment() or open_nvml())
    scheduler.swaps.gpu = gpu
    scheduler.swaps.others.start()  # what other processes hold: the memory router's budget
    scheduler.metrics.watch_gpu(gpu, lambda: footprints(scheduler.config, gpu))
    # A leader whose lease may have lapsed (paused, cut off) dispatches nothing.
    scheduler.may_dispatch = leadership.trusted
    leadership.on_lost = store.on_fenced = partial(_fenced, scheduler)
    leadership.on_renewed = scheduler.pump
    forwarder = Forwarder(config, scheduler)
    scheduler.before_each_stop(forwarder.release)
    proxy = Proxy(config, scheduler, forwarder)
    jobs = JobRunner(config, scheduler, forwarder, engine)
    jobs.fence = leadership.fence
    proxy.jobs = JobDoor(jobs)
    # Renders (ComfyUI): jobs that hold their model until their end is learnt.
    renders = proxy.renders = open_renders(config, scheduler, jobs)
    # The Videos API: held like renders; finished videos' content kept on disk.
    videos = open_videos(config, scheduler, jobs, config.video_dir or _video_dir(engine))
    batches = Batches(jobs, line_encoder(config))
    background: list[asyncio.Task[None]] = []
    gate = StandbyGate(leadership)
    failed: list[BaseException] = []

    async def lead() -> None:
        """Lead: wait for the lease as a standby if another holds it, then
        record it and recover exactly as after a crash, and open the doors."""
        lease = leadership.lease
        if lease is None:
            lease = await leadership.wait_to_lead()
            log.info("standby: took over the lease (term %d); recovering", lease.term)
        background.append(asyncio.get_running_loop().create_task(leadership.keep(), name="lease"))
        now = scheduler.clock()
        _, loads = recent_samples(engine, 0, RECENT_LOADS)  # newest first
        started = server_started(config, now, os.getpid())
        started = with_history(started, recent_footprints(engine), reversed(loads))
        scheduler.emit([lease.event(now), started])
        recovered = await recover(scheduler, engine, config.max_attempts)
        # What the short-job term and Retry-After expect, learnt from the log so far.
        scheduler.learn(recent_runs(engine, RECENT_RUNS), reversed(loads))
        # What the forecast of overtaking work learns from: the log's last week, up
        # to this start (what ends later, the scheduler sees).
        started_s = now / NS_PER_S
        history = lane_samples(engine, started_s - (DAYS + 1) * 86400.0, started_s)
        scheduler.lane_history.learn(*history)
        for ticket, job in recovered.jobs:
            jobs.run(ticket, job)
        background.append(asyncio.get_running_loop().create_task(jobs.prune_forever()))
        background.append(asyncio.get_running_loop().create_task(videos.prune_forever()))
        # Batches: queue what a crash left unqueued, finish those whose lines ended.
        background.append(asyncio.get_running_loop().create_task(batches.watch()))
        scheduler.preload_all(config.preload)
        scheduler.pump()
        loop = asyncio.get_running_loop()
        # SIGHUP is llama-swap's reload (and what a closed terminal sends): the
        # config is read again, the queue kept; it never ends the server.
        source = ConfigSource(config.source, scheduler.reload)
        loop.add_signal_handler(signal.SIGHUP, source.reload)
        if watch:
            background.append(loop.create_task(source.watch()))
        # What exists after start-up lives as long as the server: keep the collector
        # from re-walking it in full collections that stall the proxy path.
        gc.collect()
        gc.freeze()
        gate.open = True
        base = f"{'https' if tls[0] else 'http'}://{host}:{port}"
        log.info(
            "gpulane %s listening on %s (db %s); console at %s/ui/",
            __version__,
            base,
            shown(engine.url),
            base.replace("://0.0.0.0:", "://127.0.0.1:"),
        )

    def took_over(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            failed.append(task.exception())  # type: ignore[arg-type]
            server.should_exit = True

    async def startup() -> None:
        loop = asyncio.get_running_loop()
        # Any other signal that would end the process stops it as SIGTERM does,
        # so no upstream outlives it.
        for sig in (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            loop.add_signal_handler(sig, server.handle_exit, signal.SIGTERM, None)
        if leadership.lease is not None:
            try:
                await lead()  # recovered before the first request is accepted
            except BaseException as exc:
                failed.append(exc)
                raise
            return
        # A standby listens at once (/health says who leads) and leads once it can;
        # a reload waits until then (it would be an event).
        loop.add_signal_handler(signal.SIGHUP, log.info, "standby: SIGHUP ignored until it leads")
        leading = loop.create_task(lead(), name="standby")
        leading.add_done_callback(took_over)
        background.append(leading)
        log.info(
            "gpulane %s standby on %s:%d (db %s): %s",
            __version__,
            host,
            port,
            shown(engine.url),
            standby_text(leadership),
        )

    async def shutdown() -> None:
        for task in background:
            task.cancel()
        await scheduler.shutdown()
        await forwarder.close()
        await renders.aclose()
        await videos.aclose()
        await store.close()
        await leadership.release()
        if gpu.telemetry is not None:
            gpu.telemetry.close()
        # The release is the last write: closing the last connection checkpoints it
        # too, so the .db file alone is still complete after a clean stop.
        engine.dispose()
        log.info("gpulane stopped: every upstream is stopped and the log is closed")

    app = create_app(
        config,
        scheduler,
        proxy,
        logs,
        activity=lambda limit, offset, caller: activity(engine, limit, offset, caller),
        engine=engine,
        # ComfyUI's routes: their user-key isolation is tests/e2e/test_renders.py's.
        extra_handlers=[
            *extra_routes(scheduler, jobs, engine, batches),
            *comfyui_routes(renders),
            *videos_routes(videos),
        ],
        on_startup=[startup],
        on_shutdown=[shutdown],
        listen_host=host,
    )
    gate.app = app
    server = _Server(
        partial(scheduler.drain, config.shutdown_grace),
        _uvicorn_config(config, gate, (host, port), tls, lifespan="on"),
    )
    try:
        await server.serve(sockets=sockets)
    except SystemExit:
        # uvicorn exits 3 when the start-up fails, which is FENCED_EXIT: raise
        # what failed instead, as a failed start always did (cli: exit 1).
        if not failed:
            raise
    if failed:
        raise failed[0]


def _uvicorn_config(
    config: Config,
    app: ASGIApp,
    address: tuple[str, int],
    tls: tuple[str | None, str | None],
    *,
    lifespan: Literal["on", "off"],
) -> uvicorn.Config:
    return uvicorn.Config(
        # Outermost: an access line for every route, however it is mounted.
        access_log(app, lambda: config.log_requests),
        host=address[0],
        port=address[1],
        **server_options(),  # httptools, with limits on the request head
        server_header=False,  # the upstream's own Server header passes through
        ssl_certfile=tls[0],
        ssl_keyfile=tls[1],
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        # A backstop only: drain has already ended every request by then.
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace) + 5,
    )


def extra_routes(
    scheduler: Scheduler, jobs: Jobs, engine: Engine, batches: Batches | None = None
) -> list[BaseRouteHandler]:
    """The routes serve gives `create_app` beside its own: jobs, files and
    batches, reports, admin (tests/e2e/test_user_view.py walks them all with a
    user key)."""
    batches = batches or Batches(jobs, line_encoder(jobs.config))
    chains = ChainProgress(scheduler, engine)
    return [
        *job_routes(jobs),
        *file_routes(FileStore(jobs.config, engine)),
        *batch_routes(batches),
        *batch_line_routes(batches),
        *response_routes(jobs),
        *chain_routes(chains),
        *report_routes(scheduler, engine, batches.progress, chains),
        *admin_routes(scheduler),
    ]


def _fenced(scheduler: Scheduler, reason: str) -> None:
    """Another gpulane took this database over: stop at once, writing nothing more
    (no drain, no events); this server's upstreams are killed, not recorded."""
    log.error("%s; stopping now without writing anything more", reason)
    scheduler.kill_upstreams()
    logging.shutdown()
    os._exit(FENCED_EXIT)


class _Server(uvicorn.Server):
    """Drains the scheduler when a stop is asked for (SIGTERM, Ctrl-C), before
    uvicorn waits for open connections: clients still queued get their answer
    then, instead of holding the stop up for ever."""

    def __init__(self, drain: Callable[[], Awaitable[None]], config: uvicorn.Config) -> None:
        super().__init__(config)
        self._drain = drain
        self.stop_asked = False
        """A signal asked it to stop."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._drain()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stop_asked = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once stopped; a SIGTERM that ends in a
        # complete graceful stop exits 0, as service managers expect.
        if sig == signal.SIGTERM:
            self._captured_signals.remove(sig)


def _capture_logs(logs: LogBuffer) -> None:
    class ToBuffer(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append("proxy", self.format(record))

    handler = ToBuffer()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("gpulane").addHandler(handler)
