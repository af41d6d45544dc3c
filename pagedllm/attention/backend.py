"""The one attention contract: store the step's new K/V into the paged cache, then attend through the block table.

KV cache layout, per layer, for K and for V alike: [num_blocks, block_size, num_kv_heads, head_dim].
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into the cache at metadata.slot_mapping, then return causal attention output."""
        ...
