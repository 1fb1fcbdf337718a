"""What a process records when it starts or reloads its config: every input a
decision depends on, from the resolved config (`server_started`, and a
`config_reloaded`'s `parameters`)."""

from __future__ import annotations

from app import __version__
from app.config import Config
from app.core import events as ev


def server_started(config: Config, at: int, pid: int) -> ev.ServerStarted:
    """What a process records when it starts: every input a decision depends on."""
    models = config.models.values()
    return ev.ServerStarted(
        at=at,
        version=__version__,
        config_hash=config.config_hash,
        scheduler=config.scheduler,
        aging_divisor_ns=config.aging_divisor_ns,
        swap_affinity_bonus=config.swap_affinity_bonus,
        pid=pid,
        model_priority={m.id: m.fifo_priority for m in models},
        concurrency={m.id: m.concurrency_limit for m in models},
        log_format=ev.LOG_FORMAT,
        fair_share_bonus=config.fair_share_bonus,
        short_job_bonus=config.short_job_bonus,
        caller_weights={k.label: k.weight for k in config.api_keys if k.weight != 1},
        router=config.router,
        load_backoff_ns=round(config.load_backoff * 1e9),
        load_backoff_max_ns=round(config.load_backoff_max * 1e9),
        load_failure_limit=config.load_failure_limit,
        peers=config.peers or None,
        peer_choices={m.id: list(m.choices) for m in models if m.choices} or None,
        held=sorted(m.id for m in models if m.kind is not None),
        max_run_time_ns={
            m.id: round(m.max_run_time * 1e9) for m in models if m.max_run_time is not None
        },
    )
