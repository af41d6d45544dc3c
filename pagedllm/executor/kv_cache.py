"""How many KV blocks fit, and the cache itself: per layer, K and V of [num_blocks, block_size, kv_heads, head_dim].

Size order: num_kv_blocks if given, else kv_cache_memory_bytes, else a default: on CUDA what
gpu_memory_utilization leaves after the weights and the peak of a warm-up step; on CPU a share of free memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.config import EngineConfig
from pagedllm.models.spec import DecoderSpec

CPU_MEMORY_SHARE = 0.2
CPU_MAX_KV_BYTES = 1 << 30


def kv_block_bytes(spec: DecoderSpec, block_size: int, dtype: torch.dtype, tp_size: int) -> int:
    kv_heads = spec.num_kv_heads // tp_size
    return 2 * spec.num_layers * block_size * kv_heads * spec.head_dim * dtype.itemsize


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cuda_kv_budget(config: EngineConfig, device: torch.device, run_warmup: Callable[[], None]) -> int:
    """total * gpu_memory_utilization - used - (peak - current), with peak taken over a warm-up at the largest batch."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_warmup()
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    warmup_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(total * config.gpu_memory_utilization - (total - free) - warmup_extra)


def choose_num_kv_blocks(
    config: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device, run_warmup: Callable[[], None]
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = cuda_kv_budget(config, device, run_warmup)
    else:
        # Enough for max_num_seqs full-length sequences, but never more than a share of free memory.
        full_batch = -(-max_model_len // config.block_size) * config.max_num_seqs * block_bytes
        budget = min(full_batch, int(available_cpu_memory() * CPU_MEMORY_SHARE), CPU_MAX_KV_BYTES)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {budget / 2**20:.0f} MiB left, one block needs {block_bytes / 2**20:.2f} MiB; "
            "raise gpu_memory_utilization or kv_cache_memory_bytes, or use a smaller model or block_size"
        )
    return num_blocks


def allocate_kv_cache(
    spec: DecoderSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, tp_size: int
) -> torch.Tensor:
    """[2 (K, V), num_layers, num_blocks, block_size, kv_heads, head_dim], zeroed: the torch backend reads slots
    past a sequence's end (masked out, but NaN from uninitialised memory would survive the mask)."""
    shape = (2, spec.num_layers, num_blocks, block_size, spec.num_kv_heads // tp_size, spec.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, copies: torch.Tensor) -> None:
    """copies [n, 2] int64 (source, destination) block ids: every layer's K and V of each source block are copied
    to its destination (copy-on-write of a block that several samples of a request shared)."""
    kv_cache[:, :, copies[:, 1]] = kv_cache[:, :, copies[:, 0]]
