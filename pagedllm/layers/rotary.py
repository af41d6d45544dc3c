"""Rotary position embedding (neox style: the head's first and second halves rotate together).

cos/sin are precomputed once for every position up to max_position as a [max_position, head_dim // 2] table.
A step looks up its positions' rows once (`rows`, full width: cos twice, -sin then sin) and every layer rotates with
them: x * cos + swap_halves(x) * sin, which is x1 cos - x2 sin | x2 cos + x1 sin to the last bit (negating a
factor is exact), in three element-wise ops instead of a chunk, six ops and a cat for each of q and k.
Supported scalings: none ("default"), "linear" and Llama-3's "llama3".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.layers.casts import cast
from pagedllm.layers.compile import fused, fusible
from pagedllm.layers.kernel_choices import kernel_choices

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency remap: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (wavelen <= old_context_len / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition (half-width cos and sin): what `apply_rotary` computes, kept as the tests' reference."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotation_rows(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, 1, head_dim] cos and signed sin for these positions, full width."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


@fusible
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by rotation_rows' cos and sin, computed in float32."""
    x32 = cast(x, torch.float32)
    return cast(x32 * cos + swap_halves(x32) * sin, x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)
        self.apply_rotary = fused(apply_rotary, kernel_choices().compile)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotation_rows(positions, self.cos_sin)

    def forward(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] rotated by its positions' rows (self.rows)."""
        return self.apply_rotary(x, *rows)
