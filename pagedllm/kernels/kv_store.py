"""Triton kernel that writes the step's new K/V rows into the paged cache at their slot_mapping slots (-1 = skip);
into an fp8 cache as float8 e4m3 with one power-of-two scale per (token, KV head), as attention/fp8.py does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MIN_AMAX = tl.constexpr(2.0**-100)  # as attention/fp8.py's MIN_AMAX: an all-zero row gets a normal scale


@triton.jit
def fp8_scale(amax):
    """The smallest power of two s with amax / s <= 448, and 1 / s, by exact bit arithmetic (amax > 0, float32):
    amax = m * 2^e with m in [1, 2) gives s = 2^(e - 8), or 2^(e - 7) when m > 1.75."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # biased exponent of s
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def round_to_fp8(x):
    """x (float32, |x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still as float32.

    Rounding here, not in the conversion, makes the stored bytes the same on every GPU and in the interpreter
    (whose float8 conversion rounds ties up and drops the carry into the exponent)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal e4m3 (|x| >= 2^-6): keep 3 of float32's 23 mantissa bits; a carry rounds up into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9; adding 1.5 * 2^14 (whose float32 ulp is 2^-9) rounds to one.
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows(rows):
    """[heads, dims] float32 -> (fp8-representable values as float32, [heads] scales)."""
    amax = tl.maximum(tl.max(tl.abs(rows), 1), FP8_MIN_AMAX)
    scale, inverse = fp8_scale(amax)
    return round_to_fp8(rows * inverse[:, None]), scale


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, NUM_KV_HEADS, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM; padded dims are masked
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per new token: copies its [num_kv_heads, head_dim] rows of K and V into one cache slot.
    # The cache is [num_slots, NUM_KV_HEADS, HEAD_DIM] contiguous.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims < HEAD_DIM)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims
    key_offsets = token.to(tl.int64) * stride_key_token + heads[:, None] * stride_key_head + dims
    value_offsets = token.to(tl.int64) * stride_value_token + heads[:, None] * stride_value_head + dims
    key = tl.load(key_ptr + key_offsets, mask=mask, other=0.0)
    value = tl.load(value_ptr + value_offsets, mask=mask, other=0.0)
    if FP8:
        key, key_scale = _quantize_rows(key.to(tl.float32))
        value, value_scale = _quantize_rows(value.to(tl.float32))
        scale_offsets = (slot // BLOCK_SIZE) * (NUM_KV_HEADS * BLOCK_SIZE) + heads * BLOCK_SIZE + slot % BLOCK_SIZE
        tl.store(k_scale_ptr + scale_offsets, key_scale, mask=heads < NUM_KV_HEADS)
        tl.store(v_scale_ptr + scale_offsets, value_scale, mask=heads < NUM_KV_HEADS)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64; -1 = don't store
    k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32: the cache is fp8
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache.view(-1, H, D)[slot] = key[token] (and likewise V) for every token whose slot is not -1."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value rows must be contiguous in head_dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8 = k_scale is not None
    assert not fp8 or (v_scale is not None and k_scale.is_contiguous() and v_scale.is_contiguous())
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8=fp8,
    )  # fmt: skip
