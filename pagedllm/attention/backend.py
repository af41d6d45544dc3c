"""The one attention contract: store the step's new K/V into the paged cache, then attend through the block table.

KV cache layout, per layer, for K and for V alike: [num_blocks, block_size, num_kv_heads, head_dim]. An fp8 cache
(float8 e4m3) comes with float32 scales per layer, [num_blocks, num_kv_heads, block_size] for K and for V
(attention/fp8.py); a cache in the model's dtype has none.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32, fp8 caches only
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into the cache at metadata.slot_mapping (quantized, with their scales, when the cache is
        fp8), then return causal attention output."""
        ...
