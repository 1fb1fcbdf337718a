"""A model server's "out of GPU memory", read from its output, and the sentence
that tells the user so.

`out_of_memory_line` is the one place that knows what the servers gpulane runs
print when the GPU is full (llama.cpp, vLLM, SGLang, ComfyUI, anything on
PyTorch); `UpstreamProcess` asks it of every line its server writes.
`out_of_memory_error` turns such a line, and what the GPU held then, into the
error a failed load's requests get (docs/scheduling.md, "A server out of GPU
memory").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from app.runtime.gpu import GpuSnapshot

OUT_OF_MEMORY = (503, "upstream_out_of_memory")
"""The status and code of a request failed by its server running out of GPU memory."""

MAX_LINE = 400
"""A longer line is cut: it goes into an error message and an event."""

# Each pattern names where its text comes from (tests/unit/test_out_of_memory.py
# quotes each source's real line).
_PATTERNS = (
    # PyTorch (c10/cuda/CUDACachingAllocator.cpp), so vLLM, SGLang, ComfyUI:
    # "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ..." and
    # "... Allocation on device 0 would exceed allowed memory. (out of memory)";
    # the CUDA runtime's own "CUDA error: out of memory".
    r"\bCUDA (?:error: )?out of memory",
    r"\bOutOfMemoryError\b",
    r"would exceed allowed memory",
    # llama.cpp (ggml/src/ggml-cuda/ggml-cuda.cu): "...: allocating 279356.51 MiB
    # on device 0: cudaMalloc failed: out of memory" (HIP builds print the same).
    r"\b(?:cuda|hip)Malloc(?:Async)? failed: out of memory",
    # llama.cpp (ggml/src/ggml-alloc.c, src/llama-model.cpp): "failed to allocate
    # CUDA0 buffer of size N", "unable to allocate CUDA0 buffer"; a host buffer
    # (CPU) is not GPU memory.
    r"\b(?:failed|unable) to allocate (?:CUDA|ROCm|Vulkan|Metal|SYCL)\d* buffer",
    # llama.cpp's Vulkan backend (vk::OutOfDeviceMemoryError's text).
    r"\bErrorOutOfDeviceMemory\b",
    # vLLM (vllm/v1/core/kv_cache_utils.py; its GPU worker's start-up check, when
    # another process holds the memory its gpu_memory_utilization asks for).
    r"\bNo available memory for the cache blocks",
    r"\bis larger than the available KV cache memory",
    r"\bon startup is less than desired GPU memory utilization",
    # SGLang (python/sglang/srt/model_executor/model_runner.py).
    r"\bNot enough memory\. Please try to increase --mem-fraction-static",
    # ComfyUI (execution.py), after a node raised PyTorch's OOM.
    r"\bGot an OOM, unloading all loaded models",
)
_OUT_OF_MEMORY = re.compile("|".join(f"(?:{p})" for p in _PATTERNS), re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes (vLLM, ComfyUI log in colour)


_WORDS = ("memory", "alloc", "oom")
"""Every pattern holds one of these (lower case): a line with none, nearly every
line a server writes, is passed over without the expression (0.8 µs instead of 18)."""


def out_of_memory_line(line: str) -> str | None:
    """`line`, cleaned, when it says the GPU ran out of memory; else None."""
    low = line.lower()
    if not any(word in low for word in _WORDS) or _OUT_OF_MEMORY.search(line) is None:
        return None
    text = _ANSI.sub("", line).strip()
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 1] + "…"


def gpu_in_use(snapshot: GpuSnapshot | None, models: Mapping[str, Iterable[int]]) -> str | None:
    """Who held the GPU's memory in `snapshot`, a phrase: each of `models` (its
    pids) that the GPU lists, and the rest as other processes. None: no telemetry."""
    if snapshot is None:
        return None
    parts: list[str] = []
    ours = 0
    for model, pids in sorted(models.items()):
        held = snapshot.held_by(pids)
        if held:
            parts.append(f"{held} MiB by model {model!r}")
            ours += held
    others = snapshot.used_mib - ours
    if others > 0:
        parts.append(f"{others} MiB by processes gpulane did not start")
    whom = f": {', '.join(parts)}" if parts else ""
    return f"{snapshot.used_mib} of {snapshot.total_mib} MiB of GPU memory were in use{whom}"


def out_of_memory_error(line: str, in_use: str | None, error: str) -> str:
    """The error of a load that failed because its server ran out of GPU memory:
    what it printed, what the GPU held then, what to do, then the loader's `error`."""
    held = f" When it failed, {in_use}." if in_use else ""
    return (
        f"its server ran out of GPU memory ({line}).{held} Give it room: declare its "
        "gpuMemory so the memory router evicts enough for it, lower the memory router's "
        "budget, or free the GPU of what else runs there.\n" + error
    )


def died_out_of_memory(model: str, line: str, error: str) -> str:
    """The error of a request whose server died out of GPU memory while serving it."""
    return (
        f"model {model!r} ran out of GPU memory while serving this request: its server "
        f"exited ({line}). It is loaded again for the next request; if this recurs, give it "
        f"room (a smaller context or batch, or less beside it on the GPU).\n{error}"
    )


def failed_load_status(out_of_memory: str | None) -> int:
    """The HTTP status of a request whose model failed to load: 503 when its
    server ran out of GPU memory (the GPU is full, not the server broken: a later
    try may load it), else 502."""
    return 502 if out_of_memory is None else OUT_OF_MEMORY[0]
