"""The attention layer inside each decoder block: holds its slice of the KV cache and calls the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the cache exists: [num_blocks, block_size, num_kv_heads, head_dim] each;
        # with an fp8 cache also the float32 scales, [num_blocks, num_kv_heads, block_size] each (else None).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.backend is not None, "the model runner binds the KV cache and backend before any forward"
        out = self.backend.forward(
            query, key, value, self.k_cache, self.v_cache, metadata, self.scale, self.k_scale, self.v_scale
        )
        return out.flatten(1)
