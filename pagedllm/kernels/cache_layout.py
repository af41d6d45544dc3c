"""How the Triton kernels find a cache element, whatever the cache's layout.

Every kernel sees one layer's K (or V) cache as a tensor of shape [num_blocks, block_size, num_kv_heads, head_dim]
and reads its strides, so two layouts of the same shape run through the same code:
- slot-major: that shape contiguous; a slot's heads lie side by side (one KV head's head_dim values of consecutive
  slots are num_kv_heads * head_dim apart);
- head-major: allocated as [num_blocks, num_kv_heads, block_size, head_dim] and seen through transpose(1, 2)
  (executor/kv_cache.py); one KV head's slots of a block are one contiguous run, which is what a decode program (one
  sequence, one KV head) reads.
The fp8 scales are [num_blocks, num_kv_heads, block_size] contiguous in both layouts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CacheStrides(NamedTuple):
    block: int
    slot: int
    head: int
    scale_block: int  # 0 without scales


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None) -> CacheStrides:
    """The strides of K and V, which must agree and keep head_dim contiguous."""
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert k_cache.stride(3) == 1, "head_dim must be contiguous in the cache"
    scale_block = 0 if k_scale is None else k_scale.stride(0)
    return CacheStrides(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale_block)
