"""A model's `sleep` key: how its server frees the GPU without exiting.

    sleep: vllm                          # POST /sleep?level=1, POST /wake_up, GET /is_sleeping
    sleep: {preset: vllm, level: 2}      # level 2: the wake reloads the weights
    sleep: sglang                        # POST /release_memory_occupation, /resume_...
    sleep: comfyui                       # kind: comfyui only: POST /free; woken by its next prompt
    sleep: {sleep: "POST /path", wake: "POST /path", check: "GET /path"}   # any server

A model with a `sleep` key is put to sleep when evicted and woken when loaded
(docs/configuration.md, "Sleep and wake"); one without is stopped and
cold-started, as before. The presets follow the servers' own endpoints:
vLLM's `vllm/entrypoints/serve/sleep/api_router.py` (`VLLM_SERVER_DEV_MODE=1`
and `--enable-sleep-mode`; a level-2 wake is `wake_up?tags=weights`, then
`collective_rpc` `reload_weights`, then `wake_up?tags=kv_cache`, as vLLM's
sleep-mode page does it) and SGLang's `http_server.py`
(`--enable-memory-saver`).

ComfyUI (`kind: comfyui` only) follows its `server.py` and `main.py`: `POST
/free` with `{"unload_models": true, "free_memory": true}` only sets two flags
on the prompt queue and answers 200; the prompt worker acts on them between
prompts (`unload_all_models`, its caches dropped, `gc.collect`,
`soft_empty_cache`), at once when it is idle (`set_flag` wakes its wait). So
the sleep then asks `GET /queue` until nothing runs or waits there (`idle`).
ComfyUI has no wake call: it loads the weights again at its next prompt, so
the wake is one `GET /system_stats`, which tells a sleeper that still answers
from one that hung (stopped and cold-started instead). gpulane never puts it
to sleep while it holds a render: a held render is a running request, and a
model with one is never evicted.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Final

import msgspec

from app.config.checks import Issues, kind_of

PRESETS: Final = ("vllm", "sglang", "comfyui")
COMFYUI_KIND: Final = "comfyui"
"""The only `kind` that `sleep: comfyui` is for, and that takes no other preset."""
METHODS: Final = ("GET", "POST", "PUT")
DEFAULT_SLEEP_TIMEOUT: Final = 120.0
DEFAULT_WAKE_TIMEOUT: Final = 120.0
_KEYS: Final = ("preset", "level", "sleep", "wake", "check", "hostMemory", "timeout", "wakeTimeout")
_SIZE: Final = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS: Final = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


class HttpCall(msgspec.Struct, frozen=True):
    """One call to the model's own server (on its `proxy`)."""

    method: str
    path: str
    """With its query string, starting with /."""
    body: dict[str, Any] | None = None
    """A JSON body (SGLang's calls take `{}`); None: none."""

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


class SleepSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A model's `sleep` key, resolved."""

    preset: str
    """`vllm`, `sglang`, `comfyui` or `custom`."""
    sleep: tuple[HttpCall, ...]
    """The calls that put it to sleep, in order; each must answer 2xx."""
    wake: tuple[HttpCall, ...]
    """The calls that wake it, in order; each must answer 2xx."""
    check: HttpCall | None = None
    """Asked after the calls until it answers `{"is_sleeping": <expected>}` (vLLM's
    calls may return before the engine is done); None: the calls' 2xx is trusted."""
    idle: HttpCall | None = None
    """Asked after the sleep calls until it answers `{"queue_running": [],
    "queue_pending": []}` (ComfyUI's `GET /queue`: it acts on `/free` between
    prompts, so only with nothing queued or running is the memory freed now)."""
    level: int | None = None
    """vLLM's sleep level (1 keeps the weights in host memory, 2 drops them)."""
    host_memory: int = 0
    """Bytes of host memory it holds while asleep (`hostMemory`), counted against
    `sleepHostMemory`; 0: not declared (counted as nothing)."""
    sleep_timeout: float = DEFAULT_SLEEP_TIMEOUT
    """`timeout`: the longest a sleep may take before it is stopped instead."""
    wake_timeout: float = DEFAULT_WAKE_TIMEOUT
    """`wakeTimeout`: the longest a wake may take before it is stopped and
    cold-started instead."""


def vllm(level: int = 1) -> tuple[tuple[HttpCall, ...], tuple[HttpCall, ...]]:
    """vLLM's sleep and wake calls at `level`."""
    sleep = (HttpCall("POST", f"/sleep?level={level}"),)
    if level == 1:
        return sleep, (HttpCall("POST", "/wake_up"),)
    # Level 2 dropped the weights: reallocate them, load them in place, then the KV cache.
    return sleep, (
        HttpCall("POST", "/wake_up?tags=weights"),
        HttpCall("POST", "/collective_rpc", {"method": "reload_weights"}),
        HttpCall("POST", "/wake_up?tags=kv_cache"),
    )


COMFYUI_FREE: Final = HttpCall("POST", "/free", {"unload_models": True, "free_memory": True})
"""ComfyUI's `/free` as ComfyUI-Manager's "Free model and node cache" sends it: the
models unloaded and the node cache (host copies of the weights) dropped."""


def comfyui(common: dict[str, Any]) -> SleepSpec:
    """ComfyUI's sleep (`POST /free`, then `GET /queue` until idle) and wake
    (`GET /system_stats`: its next prompt loads the weights)."""
    return SleepSpec(
        preset="comfyui",
        sleep=(COMFYUI_FREE,),
        wake=(HttpCall("GET", "/system_stats"),),
        idle=HttpCall("GET", "/queue"),
        **common,
    )


def resolve_sleep(
    issues: Issues, value: Any, where: str, kind: str | None = None
) -> SleepSpec | None:
    """The `sleep` key of a model of `kind` (its `kind` key; None: a model
    server) (None: absent, or wrong: the error is recorded)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, dict):
        issues.error(
            where,
            f"expected a preset ({' or '.join(PRESETS)}) or a mapping with preset or "
            f"sleep/wake/check, got {kind_of(value)}",
        )
        return None
    for key in value:
        if key not in _KEYS:
            close = difflib.get_close_matches(str(key), _KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            issues.error(f"{where}.{key}", f"unknown key; {hint}expected one of {', '.join(_KEYS)}")
    preset = value.get("preset")
    host = _size(issues, value.get("hostMemory"), f"{where}.hostMemory")
    sleep_timeout = _seconds(
        issues, value.get("timeout"), f"{where}.timeout", DEFAULT_SLEEP_TIMEOUT
    )
    wake_timeout = _seconds(
        issues, value.get("wakeTimeout"), f"{where}.wakeTimeout", DEFAULT_WAKE_TIMEOUT
    )
    common: dict[str, Any] = {
        "host_memory": host,
        "sleep_timeout": sleep_timeout,
        "wake_timeout": wake_timeout,
    }
    if preset is not None:
        if not _fits_kind(issues, preset, kind, f"{where}.preset"):
            return None
        for key in ("sleep", "wake", "check"):
            if key in value:
                issues.error(
                    f"{where}.{key}", f"is set by preset {preset!r}; give one or the other"
                )
        if preset == "vllm":
            level = value.get("level", 1)
            if level not in (1, 2) or isinstance(level, bool):
                issues.error(
                    f"{where}.level", f"{level!r} is not a vLLM sleep level; expected 1 or 2"
                )
                level = 1
            sleep, wake = vllm(level)
            check = HttpCall("GET", "/is_sleeping")
            return SleepSpec(
                preset="vllm", sleep=sleep, wake=wake, check=check, level=level, **common
            )
        if "level" in value:
            issues.error(f"{where}.level", "only preset vllm has sleep levels")
        if preset == "comfyui":
            return comfyui(common)
        if preset == "sglang":
            # SGLang's handlers read a JSON body (tags, optional): send an empty one.
            return SleepSpec(
                preset="sglang",
                sleep=(HttpCall("POST", "/release_memory_occupation", {}),),
                wake=(HttpCall("POST", "/resume_memory_occupation", {}),),
                **common,
            )
        issues.error(
            f"{where}.preset",
            f"{preset!r} is not a sleep preset; expected one of {', '.join(PRESETS)}"
            " (or give sleep/wake/check calls)",
        )
        return None
    if "level" in value:
        issues.error(f"{where}.level", "only preset vllm has sleep levels")
    calls: dict[str, HttpCall | None] = {}
    for key in ("sleep", "wake", "check"):
        text = value.get(key)
        if text is None:
            if key != "check":
                issues.error(f"{where}.{key}", "missing: a custom sleep needs sleep and wake calls")
            calls[key] = None
            continue
        calls[key] = _call(issues, text, f"{where}.{key}")
    sleep_call, wake_call = calls["sleep"], calls["wake"]
    if sleep_call is None or wake_call is None:
        return None
    return SleepSpec(
        preset="custom", sleep=(sleep_call,), wake=(wake_call,), check=calls["check"], **common
    )


def _fits_kind(issues: Issues, preset: Any, kind: str | None, where: str) -> bool:
    """Whether `preset` is one for a model of `kind`; if not, the error says which are."""
    if preset not in PRESETS:
        return True  # named below as no preset at all
    if preset == "comfyui" and kind != COMFYUI_KIND:
        what = "a model without kind" if kind is None else f"kind {kind!r}"
        issues.error(
            where,
            f"'comfyui' is ComfyUI's sleep (POST /free): it needs kind: comfyui; for "
            f"{what} use vllm or sglang, or give sleep/wake/check calls",
        )
        return False
    if preset != "comfyui" and kind == COMFYUI_KIND:
        issues.error(
            where,
            f"{preset!r} is not a ComfyUI server's sleep; with kind: comfyui use comfyui "
            "(POST /free), or give sleep/wake/check calls",
        )
        return False
    return True


def resolve_host_memory(issues: Issues, value: Any, where: str) -> int | None:
    """`sleepHostMemory`: the host memory all sleepers may hold together (None: no bound)."""
    if value is None:
        return None
    return _size(issues, value, where)


def _call(issues: Issues, text: Any, where: str) -> HttpCall | None:
    if not isinstance(text, str) or len(text.split()) != 2:
        issues.error(where, f"{text!r} is not 'METHOD /path' (e.g. 'POST /sleep')")
        return None
    method, path = text.split()
    if method.upper() not in METHODS:
        issues.error(
            where, f"{method!r} is not a method gpulane sends; expected {', '.join(METHODS)}"
        )
        return None
    if not path.startswith("/"):
        issues.error(where, f"{path!r} must be a path starting with /")
        return None
    return HttpCall(method.upper(), path)


def _size(issues: Issues, value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        issues.error(
            where,
            f"{value!r} is not a size; expected bytes (an integer >= 0) or e.g. '72GiB', '512MB'",
        )
        return 0
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "b").lower()])


def _seconds(issues: Issues, value: Any, where: str, default: float) -> float:
    if value is None:
        return default
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and value > 0 and math.isfinite(value):
        return float(value)
    issues.error(where, f"{value!r} is out of range; expected seconds > 0")
    return default
