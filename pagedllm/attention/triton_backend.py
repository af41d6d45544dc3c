"""Triton attention backend for NVIDIA GPUs: the same contract as the torch reference, through pagedllm.kernels.

New K/V are stored through slot_mapping first (quantized to fp8 with their scales when the cache is fp8);
decode-only steps take the split-K decode kernel (the path CUDA graphs capture), every other step the varlen
paged kernel. Chosen by attention.selector.choose_backend, which falls back to torch for models it cannot take.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_limits import TRITON_HEAD_DIM_MULTIPLE, TRITON_MAX_HEAD_DIM
from pagedllm.kernels import decode_attention, prefill_attention, store_kv_cache


class TritonAttentionBackend:
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32, fp8 caches only
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        check_shapes(query, k_cache)
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.decode_only:
            return decode_attention(
                query, k_cache, v_cache, metadata.seq_lens, metadata.block_tables, scale, k_scale=k_scale,
                v_scale=v_scale,
            )  # fmt: skip
        return prefill_attention(
            query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip


def check_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The kernels pad head_dim to a power of two and map whole query-head groups to one KV head."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim % TRITON_HEAD_DIM_MULTIPLE or not 0 < head_dim <= TRITON_MAX_HEAD_DIM:
        raise ValueError(
            f"the triton backend needs head_dim a multiple of {TRITON_HEAD_DIM_MULTIPLE} up to "
            f"{TRITON_MAX_HEAD_DIM}, got {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
