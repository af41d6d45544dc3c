"""One check of kernels/rotary.rotate_qk_ against the torch path (layers/norm.rms_norm, layers/rotary.apply_rotary)
on random packed qkv rows; shared by the interpreter tests and the GPU tests. pagedllm.kernels is imported only
inside, after the caller has chosen interpret or compile."""

from __future__ import annotations

import torch
from paged_batch import bitwise_equal


def rotate_case(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: str, norm: bool, device: str = "cpu"
) -> dict:
    """Relative error of the rotated (and normalised) query and key heads against the torch path, in the dtype's
    arithmetic, and whether the value heads kept their bytes."""
    from pagedllm.kernels.rotary import rotate_qk_
    from pagedllm.layers.norm import rms_norm
    from pagedllm.layers.rotary import RotaryEmbedding, rotate_neox

    generator = torch.Generator().manual_seed(head_dim + num_q_heads)
    dtype = getattr(torch, dtype)
    num_tokens, eps = 7, 1e-6
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=generator).to(dtype).to(device)
    positions = torch.randint(0, 500, (num_tokens,), generator=generator).to(device)
    cos_sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin.to(device)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=generator)).to(dtype).to(device) for _ in range(2)]
    query, key, value = qkv.split(sizes, -1)
    query, key = query.reshape(num_tokens, num_q_heads, head_dim), key.reshape(num_tokens, num_kv_heads, head_dim)
    if norm:  # the function as written, uncompiled on CUDA too
        query, key = rms_norm(query, weights[0], eps), rms_norm(key, weights[1], eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    expected = torch.cat([rotate_neox(query, cos, sin).flatten(1), rotate_neox(key, cos, sin).flatten(1)], dim=1)
    values_before = value.clone()
    rotate_qk_(qkv, positions, cos_sin, num_q_heads, num_kv_heads, head_dim, *(weights + [eps] if norm else []))
    got, expected = qkv[:, : expected.shape[1]].double(), expected.double()
    return {
        "rel_err": ((got - expected).norm() / expected.norm()).item(),
        "values_untouched": bitwise_equal(qkv[:, expected.shape[1] :], values_before),
        "traceback": None,
    }
