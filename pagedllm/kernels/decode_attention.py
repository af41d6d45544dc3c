"""Triton split-K (flash-decoding) attention for one query token per sequence over the paged KV cache.

The grid depends only on the (padded) batch size, num_kv_heads and num_splits, never on tensor values, and the
launcher reads no tensor on the host, so a CUDA graph can capture it. Padding rows (seq_len 0) produce zeros.
Any head_dim (padded to a power of two inside, masked); an fp8 cache is upcast tile by tile (prefill_attention.py),
to the query's dtype, or to float16 with fp8_via_f16 (off by default; its docstring there says when that is exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.device import multiprocessor_count
from pagedllm.kernels.prefill_attention import attend_kv_tile, dots_in_f16, padded_head_dim

DEFAULT_BLOCK_N = 64
WIDE_HEAD_BLOCK_N = 32  # head_dim above 128: K/V tiles of all stages stay within shared memory (untuned)
# head_dim 64, 16-bit cache (TinyLlama's 32:4 heads, 256 sequences of 100..2048 tokens, H200): 128-key tiles took
# 96.7 us against 101.0 with 64 (attention_kernels.py --splits-sweep).
NARROW_HEAD_BLOCK_N = 128
# fp8 cache, bf16 model, head_dim 128: the best of attention_kernels.py --fp8-sweep on the H200 (272 us against 348
# us with the bf16 defaults at 256 x 1024 tokens; 298 against 391 on mixed lengths). Other cases keep the defaults
# (not swept; a float32 model keeps float32 dots).
FP8_HEAD_128_CONFIG = dict(block_n=128, num_stages=3, fp8_via_f16=True)
# One sequence, 8 KV heads, H200 (attention_kernels.py --splits-sweep): at 32,000 tokens 16 splits took 74 us a
# layer, 32 took 53, 64 took 51; at 1,024 tokens 11.6, 12.2 and 13.5 us. 32 keeps most of the gain for long contexts
# at 0.6 us a layer on short ones. Only batches of up to 4 sequences (at 8 KV heads) reach the cap.
MAX_SPLITS = 32
MIN_ROWS = 16  # tl.dot needs at least 16 rows: a KV head's query heads are padded up to this


def default_block_n(dim_pad: int, fp8: bool) -> int:
    """Keys per tile for a padded head size when no tuned config applies."""
    if dim_pad > 128:
        return WIDE_HEAD_BLOCK_N
    return NARROW_HEAD_BLOCK_N if dim_pad == 64 and not fp8 else DEFAULT_BLOCK_N


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM]: each split's normalised output
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32: each split's log2-sum-exp2 (-inf when empty)
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_query_token,
    stride_query_head,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_cache_block,
    stride_cache_slot,
    stride_block_table_seq,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # max(MIN_ROWS, next power of two >= GROUP)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM, at least 16; padded dims are masked
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,  # False when NUM_SPLITS == 1: partial_out is then the final output
    FP8: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,  # FP8 only: the query is rounded to float16 and both dots run in f16
):
    # Program (seq, kv_head, split) folds the split-th contiguous run of BLOCK_N-key tiles of the context.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, ROWS)
    row_head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    row_dim_valid = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_offsets = seq.to(tl.int64) * stride_query_token + row_head[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_dim_valid, other=0.0)
    if FP8_VIA_F16:
        q = q.to(tl.float16)
    row_pos = tl.zeros([ROWS], dtype=tl.int32) + (seq_len - 1)  # the query token is the last position

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(tile_begin, tile_end):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
            tile * BLOCK_N, row_pos, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
            BLOCK_SIZE, BLOCK_N, True, FP8, FP8_VIA_F16,
        )  # fmt: skip

    # An empty split (short or padding sequence) leaves l_i == 0: it writes zeros and lse -inf.
    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    partial_offsets = seq.to(tl.int64) * stride_partial_seq + row_head * stride_partial_head
    partial_offsets += split * stride_partial_split
    out_ptrs = partial_out_ptr + partial_offsets[:, None] + dims[None, :]
    tl.store(out_ptrs, out.to(partial_out_ptr.dtype.element_ty), mask=row_dim_valid)
    if STORE_LSE:  # partial_lse is laid out as partial_out without its last (HEAD_DIM) axis
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_offsets // HEAD_DIM, lse, mask=row_valid)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM] fp32, contiguous
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32, contiguous
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    stride_out_token,
    stride_out_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # out = sum_s 2^(lse_s - lse_max) * out_s / sum_s 2^(lse_s - lse_max), over the non-empty splits only.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.math.exp2(lse - lse_max), 0.0)
    total = tl.sum(weight, 0)
    partial = tl.load(partial_out_ptr + (base + splits[:, None]) * HEAD_DIM + dims[None, :],
                      mask=(splits < NUM_SPLITS)[:, None] & dim_valid[None, :], other=0.0)  # fmt: skip
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    out_offsets = seq.to(tl.int64) * stride_out_token + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits for about four programs per multiprocessor; a function of shapes only (graph-safe)."""
    programs_wanted = 4 * multiprocessor_count(device, interpreter_count=4)
    return max(1, min(MAX_SPLITS, triton.cdiv(programs_wanted, num_seqs * num_kv_heads)))


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs] int32, 0 for padding rows
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32: the cache is fp8
    v_scale: torch.Tensor | None = None,
    fp8_via_f16: bool | None = None,  # fp8 cache only: both dots in float16 (prefill_attention.py's docstring)
) -> torch.Tensor:
    """Attention of each sequence's last token over its whole paged context, split along the context.
    block_n, num_stages, fp8_via_f16: None takes the default for the cache's dtype and head size."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = padded_head_dim(head_dim)
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8 = k_scale is not None
    assert not fp8 or (v_scale is not None and k_scale.is_contiguous() and v_scale.is_contiguous())
    assert fp8 or not fp8_via_f16, "fp8_via_f16 needs an fp8 cache"
    tuned = FP8_HEAD_128_CONFIG if fp8 and head_dim == 128 and query.dtype == torch.bfloat16 else {}
    block_n = block_n or tuned.get("block_n") or default_block_n(dim_pad, fp8)
    num_stages = num_stages or tuned.get("num_stages", 3)
    fp8_via_f16 = dots_in_f16(fp8, tuned.get("fp8_via_f16", False) if fp8_via_f16 is None else fp8_via_f16, query.dtype)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, query.device)
    if num_splits == 1:  # the split kernel writes the final output itself
        partial_out, partial_lse = out.unsqueeze(2), out  # partial_lse is unused
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, partial_out, partial_lse,
        seq_lens, block_tables, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, STORE_LSE=num_splits > 1, FP8=fp8,
        FP8_VIA_F16=fp8_via_f16, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
