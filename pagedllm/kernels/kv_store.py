"""Triton kernel that writes the step's new K/V rows into the paged cache at their slot_mapping slots (-1 = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,  # = num_kv_heads * head_dim: the cache is [num_slots, num_kv_heads, head_dim] contiguous
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    # One program per new token: copies its [num_kv_heads, head_dim] rows of K and V into one cache slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    cache_offsets = slot * stride_cache_slot + heads * HEAD_DIM + dims
    key = tl.load(key_ptr + token.to(tl.int64) * stride_key_token + heads * stride_key_head + dims, mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * stride_value_token + heads * stride_value_head + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64; -1 = don't store
) -> None:
    """k_cache.view(-1, H, D)[slot] = key[token] (and likewise V) for every token whose slot is not -1."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value rows must be contiguous in head_dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        num_kv_heads * head_dim,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )
