"""Triton kernel that rotates the queries and keys in place in the packed qkv projection (neox style), after
Qwen3's per-head RMSNorms when the model has them: one kernel where the norms and the rotation took three or four.

Each program takes one token's query and key heads, [heads, head_dim] as two halves. The arithmetic follows the
torch path (layers/norm.rms_norm, layers/rotary.rotate_neox): norm statistics in float32, the normalised row rounded
to the model's dtype before the weight multiplies it, the rotation in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_qk_kernel(
    qkv_ptr,  # [num_tokens, row_stride]: query heads, then key heads, then value heads, head_dim each
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos of the HEAD_DIM // 2 angles, then their sin
    q_weight_ptr,  # [HEAD_DIM] (NORM only)
    k_weight_ptr,
    row_stride,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_Q_HEADS + NUM_K_HEADS
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= HEAD_DIM // 2; padded dims are masked
    NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < half
    mask = (heads < NUM_Q_HEADS + NUM_K_HEADS)[:, None] & dim_mask[None, :]
    first = qkv_ptr + token * row_stride + heads[:, None] * HEAD_DIM + dims[None, :]  # query heads, then key heads
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    if NORM:
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        inverse_rms = tl.rsqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / HEAD_DIM + eps)
        is_query = (heads < NUM_Q_HEADS)[:, None]
        w1 = tl.where(is_query, tl.load(q_weight_ptr + dims, mask=dim_mask)[None, :],
                      tl.load(k_weight_ptr + dims, mask=dim_mask)[None, :])  # fmt: skip
        w2 = tl.where(is_query, tl.load(q_weight_ptr + half + dims, mask=dim_mask)[None, :],
                      tl.load(k_weight_ptr + half + dims, mask=dim_mask)[None, :])  # fmt: skip
        x1 = w1 * (a1 * inverse_rms[:, None]).to(x1.dtype)
        x2 = w2 * (a2 * inverse_rms[:, None]).to(x2.dtype)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * HEAD_DIM + dims, mask=dim_mask)[None, :]
    sin = tl.load(cos_sin_ptr + position * HEAD_DIM + half + dims, mask=dim_mask)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (f1 * cos - f2 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (f2 * cos + f1 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)


def rotate_qk_(
    qkv: torch.Tensor,  # [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim], rows contiguous
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin: torch.Tensor,  # [max_position, head_dim] float32 (layers/rotary.RotaryEmbedding.cos_sin)
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,  # [head_dim]: per-head RMSNorm weights (Qwen3), else no norm
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Normalise (when weights are given) and rotate the query and key heads of every token, in place."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos_sin.is_contiguous() and cos_sin.dtype == torch.float32
    assert qkv.shape[1] >= (num_q_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    norm = q_weight is not None
    assert not norm or (k_weight is not None and q_weight.numel() == head_dim == k_weight.numel())
    if num_tokens == 0:
        return
    _rotate_qk_kernel[(num_tokens,)](
        qkv, positions, cos_sin, q_weight if norm else cos_sin, k_weight if norm else cos_sin, qkv.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_q_heads + num_kv_heads), HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2), NORM=norm,
    )  # fmt: skip
