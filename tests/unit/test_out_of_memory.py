"""What the servers gpulane runs print when the GPU is full, and what is not
that (app/runtime/out_of_memory.py). Each line is quoted as its source prints
it; where the text comes from a format string, the values are a real log's."""

from __future__ import annotations

import pytest

from app.runtime.gpu import GpuProcess, GpuSnapshot
from app.runtime.out_of_memory import (
    MAX_LINE,
    failed_load_status,
    gpu_in_use,
    out_of_memory_error,
    out_of_memory_line,
)

OUT_OF_MEMORY = {
    # llama.cpp, ggml/src/ggml-cuda/ggml-cuda.cu (ggml_backend_cuda_buffer_type_alloc_buffer:
    # "%s: allocating %.2f MiB on device %d: cudaMalloc failed: %s\n").
    "llama.cpp cudaMalloc": "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 279356.51 MiB "
    "on device 0: cudaMalloc failed: out of memory",
    # llama.cpp, ggml/src/ggml-alloc.c ("%s: failed to allocate %s buffer of size %zu\n").
    "llama.cpp gallocr": "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size "
    "292926534144",
    # llama.cpp, src/llama-model.cpp ("unable to allocate " + buffer type name + " buffer").
    "llama.cpp model load": "llama_model_load: error loading model: unable to allocate CUDA0 "
    "buffer",
    # llama.cpp's Vulkan backend: vulkan.hpp's OutOfDeviceMemoryError text.
    "llama.cpp vulkan": "terminate called after throwing an instance of "
    "'vk::OutOfDeviceMemoryError'\n  what():  vk::Device::allocateMemory: "
    "ErrorOutOfDeviceMemory",
    # PyTorch, c10/cuda/CUDACachingAllocator.cpp (vLLM, SGLang, ComfyUI all raise it).
    "torch": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has "
    "a total capacity of 79.10 GiB of which 5.06 MiB is free. Including non-PyTorch memory, "
    "this process has 79.09 GiB memory in use.",
    # PyTorch, c10/cuda/CUDACachingAllocator.cpp, with a per-process memory fraction.
    "torch fraction": "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed "
    "memory. (out of memory)",
    # ComfyUI's traceback of it on ROCm (torch prints only the start of the message).
    "comfyui torch": "torch.OutOfMemoryError: Allocation on device ",
    # ComfyUI, execution.py, after a node raised it.
    "comfyui": "Got an OOM, unloading all loaded models.",
    # The CUDA runtime's own error string, as torch.AcceleratorError prints it.
    "cuda runtime": "RuntimeError: CUDA error: out of memory",
    # vLLM, vllm/v1/core/kv_cache_utils.py, in colour as its engine core logs it.
    "vllm cache blocks": "\x1b[1;36m(EngineCore_0 pid=2319)\x1b[0;0m ValueError: No available "
    "memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
    "the engine.",
    # vLLM, vllm/v1/core/kv_cache_utils.py.
    "vllm kv cache": "ValueError: To serve at least one request with the models's max seq len "
    "(131072), (16.00 GiB KV cache is needed, which is larger than the available KV cache "
    "memory (9.47 GiB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
    "when initializing the engine.",
    # vLLM's GPU worker at start-up, another process holding the GPU (as a user's
    # log quotes it; older versions say "device (" without the "cuda:0").
    "vllm startup": "ValueError: Free memory on device cuda:0 (17.95/79.19 GiB) on startup is less "
    "than desired GPU memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or "
    "reduce GPU memory used by other processes.",
    # SGLang, python/sglang/srt/model_executor/model_runner.py.
    "sglang": "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
}

NOT_OUT_OF_MEMORY = [
    # Ordinary start-up lines of the same servers, about memory but not its lack.
    "llama_kv_cache_init:      CUDA0 KV buffer size =   379.23 MiB",
    "load_tensors: offloaded 33/33 layers to GPU",
    "ggml_gallocr_reserve_n: failed to allocate CPU buffer of size 1073741824",  # host memory
    "INFO 05-12 10:01:02 [gpu_worker.py:227] Available KV cache memory: 60.22 GiB",
    "INFO 05-12 10:01:02 [kv_cache_utils.py:634] GPU KV cache size: 1,315,424 tokens",
    "[2025-05-12 10:01:02] Memory pool end. avail mem=12.37 GB",
    "Requested to load SDXL\nloaded completely 9.5 GB 4897.05 MB",
    "srv  log_server_r: request: GET /health 127.0.0.1 200",
    "fake error: exiting at start as asked",
]


@pytest.mark.parametrize("line", OUT_OF_MEMORY.values(), ids=OUT_OF_MEMORY.keys())
def test_each_servers_out_of_memory_line_is_recognised(line: str) -> None:
    found = out_of_memory_line(line)
    assert found is not None
    assert "\x1b" not in found and found == found.strip()


@pytest.mark.parametrize("line", NOT_OUT_OF_MEMORY)
def test_other_lines_are_not(line: str) -> None:
    assert out_of_memory_line(line) is None


def test_a_long_line_is_cut() -> None:
    found = out_of_memory_line("CUDA out of memory " + "x" * 5000)
    assert found is not None and len(found) == MAX_LINE and found.endswith("…")


def test_who_held_the_gpu_names_each_model_and_the_rest() -> None:
    snap = GpuSnapshot(
        total_mib=81920,
        used_mib=75000,
        processes=(GpuProcess(10, 60000), GpuProcess(11, 1000), GpuProcess(99, 14000)),
    )
    said = gpu_in_use(snap, {"A": {10, 11}, "C": {12}})
    assert said == (
        "75000 of 81920 MiB of GPU memory were in use: 61000 MiB by model 'A', "
        "14000 MiB by processes gpulane did not start"
    )
    assert gpu_in_use(None, {"A": {10}}) is None
    empty = GpuSnapshot(total_mib=81920, used_mib=0)
    assert gpu_in_use(empty, {}) == "0 of 81920 MiB of GPU memory were in use"


def test_the_error_says_it_first_and_keeps_the_loaders() -> None:
    line = OUT_OF_MEMORY["sglang"]
    error = out_of_memory_error(line, "5 of 10 MiB of GPU memory were in use", "exited with 1")
    assert error.startswith(f"its server ran out of GPU memory ({line}). When it failed, 5 of 10")
    assert "gpuMemory" in error and error.endswith("\nexited with 1")
    assert "When it failed" not in out_of_memory_error(line, None, "x")
    assert (failed_load_status(line), failed_load_status(None)) == (503, 502)
