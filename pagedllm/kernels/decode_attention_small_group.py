"""Split-K decode attention without tensor cores, for small GQA groups (a candidate, not used by the engine yet).

decode_attention.py computes a KV head's scores with tl.dot, whose tiles have at least 16 rows: a group of 2 query
heads (Qwen3-0.6B: 16 query / 8 KV heads) leaves 14 of them padding, and an fp8 K/V tile must be converted before it
can feed the dot, which costs a trip through registers and shared memory. Here each program multiplies and sums on
the CUDA cores instead: scores [GROUP_PAD, BLOCK_N] = sum_d q[g, d] * k[n, d], out += sum_n p[g, n] * v[n, d], with
K and V upcast to float32 in registers. Work per key is 2 * GROUP * head_dim multiply-adds, which stays below
what the CUDA cores do while the memory system streams the keys, for GROUP up to about 4.

Same contract as decode_attention(): graph-safe grid, padding rows (seq_len 0) give zeros, any head_dim (masked),
fp8 caches with per-(token, KV head) power-of-two scales applied to scores and probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.decode_attention import _decode_reduce_kernel, default_num_splits
from pagedllm.kernels.prefill_attention import padded_head_dim

MAX_GROUP = 4  # past this the tl.dot kernel wastes few rows and the products here outgrow the registers


@triton.jit
def _decode_small_group_kernel(
    query_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM]
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_query_token,
    stride_query_head,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_cache_block,
    stride_cache_slot,  # = num_kv_heads * HEAD_DIM
    stride_block_table_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    row_head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row_dim_valid = row_valid[:, None] & dim_valid[None, :]
    q_offsets = seq.to(tl.int64) * stride_query_token + row_head[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_dim_valid, other=0.0).to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(tile_begin, tile_end):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < seq_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_N]
        if FP8:  # a key's scale multiplies its scores, a value's scale its probabilities: powers of two, exact
            scale_offsets = block_ids * (stride_cache_slot // HEAD_DIM * BLOCK_SIZE) + kv_head * BLOCK_SIZE
            scale_offsets += key_pos % BLOCK_SIZE
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            scores = scores * (k_scale * scale_log2)[None, :]
        else:
            scores = scores * scale_log2
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        # Invariant: a tile in [tile_begin, tile_end) holds at least one valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    partial_offsets = seq.to(tl.int64) * stride_partial_seq + row_head * stride_partial_head
    partial_offsets += split * stride_partial_split
    tl.store(partial_out_ptr + partial_offsets[:, None] + dims[None, :], out.to(partial_out_ptr.dtype.element_ty),
             mask=row_dim_valid)  # fmt: skip
    if STORE_LSE:
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_offsets // HEAD_DIM, lse, mask=row_valid)


def decode_attention_small_group(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs] int32, 0 for padding rows
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """decode_attention() on the CUDA cores, for num_heads // num_kv_heads <= MAX_GROUP."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert group <= MAX_GROUP, f"GQA group {group} > {MAX_GROUP}: use decode_attention()"
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8 = k_scale is not None
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    num_splits = num_splits or default_num_splits(num_seqs, num_kv_heads, query.device)
    if num_splits == 1:
        partial_out, partial_lse = out.unsqueeze(2), out
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    dim_pad = padded_head_dim(head_dim)
    _decode_small_group_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, partial_out, partial_lse,
        seq_lens, block_tables, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, STORE_LSE=num_splits > 1, FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
