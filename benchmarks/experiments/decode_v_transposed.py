"""Experiment (offline compile only, not used by the engine): the decode split kernel over a V cache stored with
the keys contiguous within each block, [num_blocks, num_kv_heads, head_dim, block_size], instead of the engine's
[num_blocks, block_size, num_kv_heads, head_dim].

Why: V is the B operand of P·V, whose K dimension is the key axis. In the engine's layout the keys are strided, so an
fp8 V tile goes from shared memory into the MMA operand one byte per LDS (no 8-bit transposing ldmatrix on sm_90);
with the keys contiguous, V^T is read like K is (words of 4 keys) and tl.trans makes it the operand.

Triton must see the contiguity: a [DIM_PAD, BLOCK_N] tile's key offsets run BLOCK_SIZE at a time between block-table
lookups, which its axis analysis cannot tell from the loaded block ids. So a transposed tile is loaded as
[DIM_PAD, BLOCK_N // BLOCK_SIZE, BLOCK_SIZE] (the last axis a plain arange: contiguous, BLOCK_SIZE-aligned) and
reshaped. A per-key mask would also break the vector loads (it changes along the contiguous axis), so the kernel
peels the sequence's last, partial tile: whole tiles are attended without any mask, the partial one with per-key
masks (one tile per sequence). PEEL_LAST_TILE applies to either layout, to tell its gain from the layout's.

K_TRANSPOSED stores K the same way ([num_blocks, num_kv_heads, head_dim, block_size]) and computes Q·K^T from the
[DIM_PAD, BLOCK_N] tile directly; in the engine's layout K's MMA K dimension (head_dim) is already contiguous.

benchmarks/compile_report.py --v-transposed compiles it for sm_90; tests/kernels/test_decode_v_transposed.py checks
it under the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.decode_attention import (
    DEFAULT_BLOCK_N,
    MIN_ROWS,
    WIDE_HEAD_BLOCK_N,
    _decode_reduce_kernel,
    default_num_splits,
)
from pagedllm.kernels.prefill_attention import padded_head_dim


def transpose_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_dim] -> [num_blocks, num_kv_heads, head_dim, block_size]."""
    return cache.permute(0, 2, 3, 1).contiguous()


@triton.jit
def _load_tile(
    cache_ptr,
    block_table_ptr,
    block_ids,  # [BLOCK_N] int64: each key's block
    key_pos,  # [BLOCK_N] tile_start + arange(BLOCK_N)
    key_valid,  # [BLOCK_N] bool (MASKED only): keys outside read zeros
    kv_head,
    tile_start,
    stride_cache_block,
    stride_cache_slot,  # = num_kv_heads * HEAD_DIM (engine layout only)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    TRANSPOSED: tl.constexpr,  # the cache is [num_blocks, num_kv_heads, HEAD_DIM, BLOCK_SIZE]
):
    """The keys [tile_start, tile_start + BLOCK_N): a [BLOCK_N, DIM_PAD] tile, or [DIM_PAD, BLOCK_N] if TRANSPOSED."""
    dims = tl.arange(0, DIM_PAD)
    if TRANSPOSED and MASKED:
        # Element (p, kv_head, d) at block_table[p // BLOCK_SIZE] * stride_cache_block
        #   + (kv_head * HEAD_DIM + d) * BLOCK_SIZE + p % BLOCK_SIZE: BLOCK_SIZE keys contiguous per block.
        # The partial tile: the mask changes along the keys, so byte loads (once per sequence).
        offsets = (kv_head * HEAD_DIM + dims)[:, None] * BLOCK_SIZE
        offsets += (block_ids * stride_cache_block + key_pos % BLOCK_SIZE)[None, :]
        tile = tl.load(cache_ptr + offsets, mask=(dims < HEAD_DIM)[:, None] & key_valid[None, :], other=0.0)
    elif TRANSPOSED:
        # A whole tile: runs of RUN contiguous keys (RUN-aligned, within one block), the run an axis of its own.
        RUN: tl.constexpr = min(BLOCK_N, BLOCK_SIZE)
        NUM_RUNS: tl.constexpr = BLOCK_N // RUN
        run_start = tile_start + tl.arange(0, NUM_RUNS) * RUN
        run_blocks = tl.load(block_table_ptr + run_start // BLOCK_SIZE).to(tl.int64)
        offsets = (kv_head * HEAD_DIM + dims)[:, None, None] * BLOCK_SIZE
        offsets += (run_blocks * stride_cache_block + run_start % BLOCK_SIZE)[None, :, None]
        offsets += tl.arange(0, RUN)[None, None, :]
        if DIM_PAD != HEAD_DIM:
            runs = tl.load(cache_ptr + offsets, mask=(dims < HEAD_DIM)[:, None, None], other=0.0)
        else:
            runs = tl.load(cache_ptr + offsets)
        tile = tl.reshape(runs, [DIM_PAD, BLOCK_N])
    else:
        # Engine layout (attend_kv_tile's): element (p, kv_head, d) at block_table[p // BLOCK_SIZE]
        #   * stride_cache_block + (p % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM + d.
        offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
        offsets = offsets[:, None] + kv_head * HEAD_DIM + dims[None, :]
        if DIM_PAD != HEAD_DIM:
            valid = key_valid if MASKED else key_pos >= 0
            tile = tl.load(cache_ptr + offsets, mask=valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        elif MASKED:
            tile = tl.load(cache_ptr + offsets, mask=key_valid[:, None], other=0.0)
        else:
            tile = tl.load(cache_ptr + offsets)
    return tile


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    kv_head,
    tile_start,
    kv_end,
    scale_log2,
    stride_cache_block,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,
    K_TRANSPOSED: tl.constexpr,
    V_TRANSPOSED: tl.constexpr,
    FP8_PV: tl.constexpr,  # FP8_VIA_F16 only: P·V as an fp8 MMA, the probabilities rounded to e4m3
):
    """prefill_attention.attend_kv_tile for one query position (the last, kv_end - 1), over either cache layout."""
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    key_valid = key_pos < kv_end
    if MASKED:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE).to(tl.int64)
    k = _load_tile(k_cache_ptr, block_table_ptr, block_ids, key_pos, key_valid, kv_head, tile_start,
                   stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, MASKED,
                   K_TRANSPOSED)  # fmt: skip
    v = _load_tile(v_cache_ptr, block_table_ptr, block_ids, key_pos, key_valid, kv_head, tile_start,
                   stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, MASKED,
                   V_TRANSPOSED)  # fmt: skip
    scores = tl.dot(q, k.to(q.dtype)) if K_TRANSPOSED else tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:  # scale (p, kv_head) at block_table[p // BLOCK_SIZE] * num_kv_heads * BLOCK_SIZE + kv_head * BLOCK_SIZE
        #   + p % BLOCK_SIZE, as attend_kv_tile
        scale_offsets = block_ids * (stride_cache_block // HEAD_DIM) + kv_head * BLOCK_SIZE + key_pos % BLOCK_SIZE
        if MASKED:
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_offsets)
            v_scale = tl.load(v_scale_ptr + scale_offsets)
        scores = scores * (k_scale * scale_log2)[None, :]
    else:
        scores = scores * scale_log2
    if MASKED:  # the query is the last position, kv_end - 1: it sees every key below kv_end
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_VIA_F16:  # as attend_kv_tile: p scaled relative to the tile's largest v_scale stays in [0, 1]
        v_scale_max = tl.max(v_scale, 0)
        p = p * (v_scale / v_scale_max)[None, :]
    elif FP8:
        p = p * v_scale[None, :]
    if FP8_PV and V_TRANSPOSED:
        pv = tl.dot(p.to(v.dtype), tl.trans(v))
    elif FP8_PV:
        pv = tl.dot(p.to(v.dtype), v)
    elif V_TRANSPOSED:
        pv = tl.dot(p.to(q.dtype), tl.trans(v.to(q.dtype)))
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    if FP8_VIA_F16:
        pv = pv * v_scale_max
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_tile_swapped(
    q,
    m_i,
    l_i,
    acc_t,  # [DIM_PAD, ROWS]: the accumulator transposed
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    kv_head,
    tile_start,
    kv_end,
    scale_log2,
    stride_cache_block,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FP8_PV: tl.constexpr,
):
    """_attend_tile with the dots' operands swapped (FP8_VIA_F16, V transposed): S^T = K·Q^T ([BLOCK_N, ROWS]) and
    O^T += V^T·P^T, so the MMAs' M dimension is the keys and head_dim (64 and up: Hopper's warpgroup MMA) and the
    few query rows are N, instead of query rows padded to 16 or 64. V^T, keys contiguous, is the A operand."""
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    key_valid = key_pos < kv_end
    if MASKED:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE).to(tl.int64)
    k = _load_tile(k_cache_ptr, block_table_ptr, block_ids, key_pos, key_valid, kv_head, tile_start,
                   stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, MASKED,
                   False)  # fmt: skip
    v_t = _load_tile(v_cache_ptr, block_table_ptr, block_ids, key_pos, key_valid, kv_head, tile_start,
                     stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD, BLOCK_SIZE, BLOCK_N, MASKED,
                     True)  # fmt: skip
    scores_t = tl.dot(k.to(q.dtype), tl.trans(q))
    scale_offsets = block_ids * (stride_cache_block // HEAD_DIM) + kv_head * BLOCK_SIZE + key_pos % BLOCK_SIZE
    if MASKED:
        k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
    else:
        k_scale = tl.load(k_scale_ptr + scale_offsets)
        v_scale = tl.load(v_scale_ptr + scale_offsets)
    scores_t = scores_t * (k_scale * scale_log2)[:, None]
    if MASKED:
        scores_t = tl.where(key_valid[:, None], scores_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores_t, 0))
    alpha = tl.math.exp2(m_i - m_new)
    p_t = tl.math.exp2(scores_t - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p_t, 0)
    v_scale_max = tl.max(v_scale, 0)
    p_t = p_t * (v_scale / v_scale_max)[:, None]
    pv_t = tl.dot(v_t, p_t.to(v_t.dtype)) if FP8_PV else tl.dot(v_t.to(q.dtype), p_t.to(q.dtype))
    acc_t = acc_t * alpha[None, :] + pv_t * v_scale_max
    return m_new, l_i, acc_t


@triton.jit
def _decode_split_kernel_vt(
    query_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    k_cache_ptr,  # engine layout, or [num_blocks, num_kv_heads, HEAD_DIM, BLOCK_SIZE] if K_TRANSPOSED
    v_cache_ptr,  # likewise with V_TRANSPOSED
    k_scale_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_query_token,
    stride_query_head,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_cache_block,  # = num_kv_heads * HEAD_DIM * BLOCK_SIZE in both layouts
    stride_cache_slot,  # = num_kv_heads * HEAD_DIM (engine layout)
    stride_block_table_seq,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,
    K_TRANSPOSED: tl.constexpr,
    V_TRANSPOSED: tl.constexpr,
    PEEL_LAST_TILE: tl.constexpr,  # whole tiles without masks, the partial last tile apart (forced by a layout)
    FP8_PV: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,  # FP8_VIA_F16 and V_TRANSPOSED, peeled: _attend_tile_swapped
):
    # As decode_attention._decode_split_kernel, but for the tile loop.
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

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    if SWAP_AB:
        acc_t = tl.zeros([DIM_PAD, ROWS], dtype=tl.float32)
        partial_tile = seq_len // BLOCK_N
        for tile in range(tile_begin, tl.minimum(tile_end, partial_tile)):
            m_i, l_i, acc_t = _attend_tile_swapped(
                q, m_i, l_i, acc_t, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
                tile * BLOCK_N, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
                BLOCK_SIZE, BLOCK_N, False, FP8_PV,
            )  # fmt: skip
        if partial_tile >= tile_begin and partial_tile < tile_end:
            m_i, l_i, acc_t = _attend_tile_swapped(
                q, m_i, l_i, acc_t, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
                partial_tile * BLOCK_N, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM,
                DIM_PAD, BLOCK_SIZE, BLOCK_N, True, FP8_PV,
            )  # fmt: skip
        acc = tl.trans(acc_t)
    elif PEEL_LAST_TILE:
        # Tiles below seq_len // BLOCK_N are whole; the tile at seq_len // BLOCK_N, if any, is partial.
        partial_tile = seq_len // BLOCK_N
        for tile in range(tile_begin, tl.minimum(tile_end, partial_tile)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
                tile * BLOCK_N, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
                BLOCK_SIZE, BLOCK_N, False, FP8, FP8_VIA_F16, K_TRANSPOSED, V_TRANSPOSED, FP8_PV,
            )  # fmt: skip
        if partial_tile >= tile_begin and partial_tile < tile_end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
                partial_tile * BLOCK_N, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM,
                DIM_PAD, BLOCK_SIZE, BLOCK_N, True, FP8, FP8_VIA_F16, K_TRANSPOSED, V_TRANSPOSED, FP8_PV,
            )  # fmt: skip
    else:
        for tile in range(tile_begin, tile_end):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
                tile * BLOCK_N, seq_len, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
                BLOCK_SIZE, BLOCK_N, True, FP8, FP8_VIA_F16, K_TRANSPOSED, V_TRANSPOSED, FP8_PV,
            )  # fmt: skip

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    partial_offsets = seq.to(tl.int64) * stride_partial_seq + row_head * stride_partial_head
    partial_offsets += split * stride_partial_split
    out_ptrs = partial_out_ptr + partial_offsets[:, None] + dims[None, :]
    tl.store(out_ptrs, out.to(partial_out_ptr.dtype.element_ty), mask=row_dim_valid)
    if STORE_LSE:
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_offsets // HEAD_DIM, lse, mask=row_valid)


def decode_attention_transposed(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # engine layout, or [num_blocks, num_kv_heads, head_dim, block_size] if k_transposed
    v_cache: torch.Tensor,  # likewise with v_transposed
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_via_f16: bool = False,
    k_transposed: bool = False,
    v_transposed: bool = True,
    peel_last_tile: bool = True,
    fp8_pv: bool = False,  # fp8_via_f16 only: P·V as an fp8 MMA (probabilities rounded to e4m3)
    swap_ab: bool = False,  # fp8_via_f16, v_transposed and peeled only: S^T = K·Q^T, O^T += V^T·P^T
    min_rows: int = MIN_ROWS,  # query rows of a program at least (64: Hopper's warpgroup MMA for 4 warps)
) -> torch.Tensor:
    """decode_attention over caches in either layout (a transposed layout without peel_last_tile reads every tile
    with per-key masks, i.e. byte by byte: for the comparison only)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1] if k_transposed else k_cache.shape[2]
    block_size = k_cache.shape[3] if k_transposed else k_cache.shape[1]
    group = num_heads // num_kv_heads
    dim_pad = padded_head_dim(head_dim)
    block_n = block_n or (DEFAULT_BLOCK_N if dim_pad <= 128 else WIDE_HEAD_BLOCK_N)
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8 = k_scale is not None
    assert fp8_via_f16 or not (fp8_pv or swap_ab), "fp8_pv and swap_ab scale p as fp8_via_f16 does"
    assert not swap_ab or (v_transposed and peel_last_tile and not k_transposed)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, query.device)
    if num_splits == 1:
        partial_out, partial_lse = out.unsqueeze(2), out
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel_vt[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, partial_out, partial_lse,
        seq_lens, block_tables, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        k_cache.stride(0), num_kv_heads * head_dim, block_tables.stride(0),
        GROUP=group, ROWS=max(min_rows, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, STORE_LSE=num_splits > 1, FP8=fp8,
        FP8_VIA_F16=fp8_via_f16, K_TRANSPOSED=k_transposed, V_TRANSPOSED=v_transposed,
        PEEL_LAST_TILE=peel_last_tile, FP8_PV=fp8_pv, SWAP_AB=swap_ab, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
