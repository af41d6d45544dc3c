"""Triton attention backend for NVIDIA GPUs: the same contract as the torch reference, through pagedllm.kernels.

New K/V are stored through slot_mapping first; decode-only steps take the split-K decode kernel (the path CUDA
graphs capture), every other step the varlen paged kernel.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        check_shapes(query, k_cache)
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        if metadata.decode_only:
            return decode_attention(query, k_cache, v_cache, metadata.seq_lens, metadata.block_tables, scale)
        return prefill_attention(
            query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale
        )


def check_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The kernels tile head_dim by a power of two and map whole query-head groups to one KV head."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"the triton backend needs a power-of-two head_dim in 16..256, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
