"""One paged attention step built at random, and the check of the Triton kernels on it against the torch reference.

Shared by the interpreter tests (CPU, TRITON_INTERPRET=1) and the GPU tests and benchmark; pagedllm.kernels is
imported only inside check_step, after the caller has chosen interpret or compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedllm.attention.fp8 import FP8_DTYPE, SCALE_DTYPE, dequantize_fp8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import paged_attention
from pagedllm.attention.torch_backend import store_kv_cache as reference_store


@dataclass(frozen=True)
class Step:
    query_lens: tuple[int, ...]  # new tokens per sequence this step
    seq_lens: tuple[int, ...]  # context after the step (cached + new); 0 = padding row (decode only)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"  # of the queries and the model; the cache too unless kv_cache_dtype is "fp8"
    kv_cache_dtype: str = "auto"
    skip_slots: tuple[int, ...] = ()  # token rows whose slot_mapping is -1 (their K/V are already cached)
    kernel_args: dict = field(default_factory=dict)  # tile sizes / num_splits passed to the launcher
    value_scale: float = 1.0  # multiplies every value row, cached and new: tiny values test float16 underflow
    through_backend: bool = False  # call TritonAttentionBackend.forward instead of the kernels

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (a view of a packed qkv tensor, like key and value)
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, num_kv_heads, block_size] float32 with an fp8 cache
    v_scale: torch.Tensor | None
    metadata: AttentionMetadata

    def caches(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.k_cache, self.v_cache, self.k_scale, self.v_scale) if t is not None)


def make_batch(step: Step, generator: torch.Generator, device: str = "cpu", poison: bool = True) -> PagedBatch:
    """Blocks in random order. poison: the cache (and scales) are NaN except the cached context, and block 0, which
    every unused block-table entry points to, is all NaN, so any read outside a sequence's context shows as NaN."""
    dtype = getattr(torch, step.dtype)
    # Values are drawn on the device (fast for benchmark sizes), from a seed that the CPU generator gives.
    data_generator = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
    random = lambda *shape: torch.randn(*shape, generator=data_generator, device=device).to(dtype)
    q_lens, s_lens = torch.tensor(step.query_lens), torch.tensor(step.seq_lens)
    num_seqs, num_tokens, block_size = len(step.seq_lens), int(q_lens.sum()), step.block_size
    blocks_per_seq = (s_lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + 3
    block_tables = torch.zeros(num_seqs, max(int(blocks_per_seq.max()), 1), dtype=torch.int32)
    used = torch.arange(block_tables.shape[1])[None] < blocks_per_seq[:, None]
    block_tables[used] = (1 + torch.randperm(num_blocks - 1, generator=generator)[: int(used.sum())]).int()

    # Every context position: its sequence, position and cache slot; new tokens also get their packed row's slot.
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), s_lens)
    pos = torch.arange(int(s_lens.sum())) - torch.repeat_interleave(s_lens.cumsum(0) - s_lens, s_lens)
    slots = block_tables[seq_of, pos // block_size].long() * block_size + pos % block_size
    context_lens = (s_lens - q_lens)[seq_of]
    is_new = pos >= context_lens
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long)  # a padding row's token keeps slot -1
    slot_mapping[(query_start_loc[seq_of] + pos - context_lens)[is_new]] = slots[is_new]
    cached = ~is_new
    for token in step.skip_slots:  # K/V of a skipped token (slot -1) is already in the cache
        cached |= slots == slot_mapping[token]
        slot_mapping[token] = -1

    fp8 = step.kv_cache_dtype == "fp8"
    shape = (num_blocks, block_size, step.num_kv_heads, step.head_dim)
    scale_shape = (num_blocks, step.num_kv_heads, block_size)
    fill = float("nan") if poison else 0.0
    k_cache, v_cache = (torch.full(shape, fill, device=device).to(FP8_DTYPE if fp8 else dtype) for _ in range(2))
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = (torch.full(scale_shape, fill, dtype=SCALE_DTYPE, device=device) for _ in range(2))
    cached_slots = slots[cached].to(device)
    context = [random(len(cached_slots), *shape[2:]) for _ in range(2)]
    context[1] *= step.value_scale
    reference_store(*context, k_cache, v_cache, cached_slots, k_scale, v_scale)

    qkv = random(num_tokens, step.num_heads + 2 * step.num_kv_heads, step.head_dim)
    qkv[:, step.num_heads + step.num_kv_heads :] *= step.value_scale
    query, key, value = qkv.split([step.num_heads, step.num_kv_heads, step.num_kv_heads], dim=1)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.int().to(device),
        seq_lens=s_lens.int().to(device),
        block_tables=block_tables.to(device),
        max_query_len=max(step.query_lens),
        max_seq_len=max(step.seq_lens),
        decode_only=step.decode_only,
    )
    return PagedBatch(query, key, value, k_cache, v_cache, k_scale, v_scale, metadata)


def reference_attention(batch: PagedBatch, scale: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(float64 attention output, caches after the reference store): the torch backend's store, then its attention
    on the cache as the kernels see it (fp8 dequantized exactly, NaN poison zeroed)."""
    caches = tuple(t.clone() for t in batch.caches())
    k_scale, v_scale = (caches[2], caches[3]) if batch.k_scale is not None else (None, None)
    reference_store(batch.key, batch.value, caches[0], caches[1], batch.metadata.slot_mapping, k_scale, v_scale)
    if k_scale is None:
        k_cache, v_cache = (cache.double().nan_to_num() for cache in caches[:2])
    else:
        k_cache = dequantize_fp8(caches[0], k_scale.transpose(1, 2), torch.float64).nan_to_num()
        v_cache = dequantize_fp8(caches[1], v_scale.transpose(1, 2), torch.float64).nan_to_num()
    return paged_attention(batch.query.double(), k_cache, v_cache, batch.metadata, scale), caches


def run_kernels(batch: PagedBatch, step: Step, scale: float) -> torch.Tensor:
    """Store and attend with the Triton kernels (or the backend) into a NaN-poisoned output."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.kernels import decode_attention, prefill_attention, store_kv_cache

    md, scales = batch.metadata, dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    if step.through_backend:
        return TritonAttentionBackend().forward(
            batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, md, scale, **scales
        )
    slot_mapping = md.slot_mapping if step.decode_only else md.slot_mapping.int()  # both index types work
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, slot_mapping, **scales)
    out = torch.full_like(batch.query, float("nan"))
    if step.decode_only:
        decode_attention(batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, scale, out=out,
                         **scales, **step.kernel_args)  # fmt: skip
    else:
        prefill_attention(batch.query, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens,
                          md.block_tables, scale, out=out, **scales, **step.kernel_args)  # fmt: skip
    return out


def check_step(step: Step, generator: torch.Generator, device: str = "cpu") -> dict:
    """Store must write exactly the reference's bytes (values and fp8 scales); attention must match the float64
    reference on the real rows (seq_len > 0) and write zeros on padding rows."""
    batch = make_batch(step, generator, device)
    scale = step.head_dim**-0.5
    reference, reference_caches = reference_attention(batch, scale)
    out = run_kernels(batch, step, scale)
    real = batch.metadata.seq_lens > 0 if step.decode_only else torch.ones(out.shape[0], dtype=torch.bool)
    real = real.to(out.device)
    error = ((out[real].double() - reference[real]).norm() / reference[real].norm()).item()
    return {
        "cache_matches": all(bitwise_equal(a, b) for a, b in zip(batch.caches(), reference_caches)),
        "all_written": not bool(out.isnan().any()),
        "padding_rows_zero": bool((out[~real] == 0).all()),
        "rel_err": error if math.isfinite(error) else float("inf"),
    }


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bytes (NaN poison included)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
