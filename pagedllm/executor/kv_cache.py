"""How many KV blocks fit, and the cache itself: per layer, K and V of [num_blocks, block_size, kv_heads, head_dim]
(and with kv_cache_dtype="fp8", float32 scales of [num_blocks, kv_heads, block_size] for each; attention/fp8.py).

Size order: num_kv_blocks if given, else kv_cache_memory_bytes, else a default: on CUDA what
gpu_memory_utilization leaves after the weights and the peak of a warm-up step; on CPU a share of free memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.fp8 import FP8_DTYPE, SCALE_DTYPE
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.cpu_memory import mapped_zeros
from pagedllm.layers.parallel_state import kv_heads_per_rank
from pagedllm.models.spec import DecoderSpec

# On CPU by default: a fifth of free memory, at most 4 GiB (vLLM's CPU default, VLLM_CPU_KVCACHE_SPACE=4). The map
# is written lazily (zeros below), so pages a run never writes cost nothing; 1 GiB (~23K tokens of the default model
# in float32) preempted nano-vllm's 64 sequences (benchmarks/NOTES.md, session 34).
CPU_MEMORY_SHARE = 0.2
CPU_MAX_KV_BYTES = 4 << 30


@dataclass(slots=True)
class KVCache:
    keys: torch.Tensor  # [num_layers, num_blocks, block_size, kv_heads, head_dim]
    values: torch.Tensor
    key_scales: torch.Tensor | None  # [num_layers, num_blocks, kv_heads, block_size] float32; fp8 caches only
    value_scales: torch.Tensor | None

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """copies [n, 2] int64 (source, destination) block ids: every layer's K and V (and scales) of each source
        block are copied to its destination (copy-on-write of a block that several samples of a request shared).
        Float8 goes through uint8 views: index ops need not support float8 on every device."""
        for tensor in (self.keys, self.values, self.key_scales, self.value_scales):
            if tensor is not None:
                raw = tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor
                raw[:, copies[:, 1]] = raw[:, copies[:, 0]]


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV values are stored in: EngineConfig.kv_cache_dtype "auto" = the model's, "fp8" = e4m3."""
    return FP8_DTYPE if kv_cache_dtype == "fp8" else model_dtype


@dataclass(frozen=True, slots=True)
class CompanionMemory:
    """Device memory another model of this process takes beside the engine's (a draft model): per block of the
    engine's block count, whose KV cache it mirrors, and once (its weights). The engine's cache leaves both free, and
    the companion's activations as much room as the engine's own warm-up peak (a draft is the smaller model)."""

    block_bytes: int
    fixed_bytes: int


def kv_block_bytes(
    spec: DecoderSpec, block_size: int, dtype: torch.dtype, tp_size: int, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one block of one rank (which holds only its own KV heads) over all layers, K and V, scales included."""
    kv_heads = kv_heads_per_rank(spec.num_kv_heads, tp_size)
    bytes_per_head = spec.head_dim * cache_dtype(kv_cache_dtype, dtype).itemsize
    if kv_cache_dtype == "fp8":
        bytes_per_head += SCALE_DTYPE.itemsize
    return 2 * spec.num_layers * block_size * kv_heads * bytes_per_head


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def measure_warmup_peak(device: torch.device, run_warmup: Callable[[], None]) -> int:
    """Run the warm-up and return the memory it needed beyond what stays allocated (its activations' peak); the
    allocator's cache is emptied after it, so free memory can be read."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_warmup()
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    torch.cuda.empty_cache()
    return stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]


def cuda_kv_budget(config: EngineConfig, device: torch.device, warmup_peak: int) -> int:
    """total * gpu_memory_utilization - used - the warm-up's peak (measure_warmup_peak, at the largest batch)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * config.gpu_memory_utilization - (total - free) - warmup_peak)


def choose_num_kv_blocks(
    config: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device, warmup_peak: int = 0
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = cuda_kv_budget(config, device, warmup_peak)
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
    spec: DecoderSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int,
    kv_cache_dtype: str = "auto",
) -> KVCache:
    """Zeroed: the torch backend reads slots past a sequence's end (masked out, but NaN from uninitialised memory
    would survive the mask)."""
    kv_heads = kv_heads_per_rank(spec.num_kv_heads, tp_size)
    shape = (spec.num_layers, num_blocks, block_size, kv_heads, spec.head_dim)
    values_dtype = cache_dtype(kv_cache_dtype, dtype)
    keys, values = (zeros(shape, values_dtype, device) for _ in range(2))
    if kv_cache_dtype != "fp8":
        return KVCache(keys, values, None, None)
    scale_shape = (spec.num_layers, num_blocks, kv_heads, block_size)
    key_scales, value_scales = (zeros(scale_shape, SCALE_DTYPE, device) for _ in range(2))
    return KVCache(keys, values, key_scales, value_scales)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On the CPU, a map of its own (cpu_memory.mapped_zeros): pages the OS maps when first written, not now, so a
    large cache costs nothing at start-up (torch.zeros wrote 1 GiB in ~2.5 s on a 2-core machine), asked for in 2 MiB
    pages: a prompt's first writes into fresh blocks then fault once per 2 MiB rather than per 4 KiB, ~20x less time
    (benchmarks/NOTES.md, session 32), at the price of resident memory that grows in 2 MiB steps."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return mapped_zeros(shape, dtype)


def bind_kv_cache(model: nn.Module, cache: KVCache, backend: AttentionBackend) -> None:
    """Give each attention layer, in model order, its layer of the cache and the backend."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    assert len(layers) == cache.keys.shape[0], "one cache layer per attention layer"
    for index, layer in enumerate(layers):
        layer.k_cache, layer.v_cache, layer.backend = cache.keys[index], cache.values[index], backend
        if cache.key_scales is not None:
            layer.k_scale, layer.v_scale = cache.key_scales[index], cache.value_scales[index]
        else:
            layer.k_scale = layer.v_scale = None
