"""Triton varlen causal attention over the paged KV cache: fresh prefill, prefix hits, chunks and mixed batches.

Query row j of sequence i sits at position seq_lens[i] - query_len_i + j and sees the cached keys at positions <= it.
The step's new K/V must already be in the cache (store_kv_cache runs first). head_dim is tiled at the next power of
two and the padding masked; an fp8 cache (float8 e4m3 values, power-of-two scales per position and KV head) is
converted to the query's dtype tile by tile, and its scales multiply the scores and the probabilities.

fp8_via_f16 (off by default) runs both dots of an fp8 cache in float16 whatever the model's dtype: sm_89+ converts
e4m3 to f16 in one packed instruction per pair, while e4m3 to bf16 goes through f16 and a scalar conversion per value
(Triton 3.6 on sm_90). The query is rounded to f16 (10 mantissa bits, more than bf16's 7; fine while |q| < 65504,
which RMSNorm/RoPE activations are); the probabilities carry the values' scales relative to the tile's largest one,
so they stay in [0, 1] and never underflow f16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows of one program: BLOCK_M = tokens_per_tile * group query heads, flattened token-major:
#   row r -> token first_token + r // GROUP, query head kv_head * GROUP + r % GROUP
# so every query head of one KV head shares each K/V tile loaded from the cache.
DEFAULT_BLOCK_M = 64  # H200, 4 x 1024 tokens, head_dim 128: 81 us at 64 rows, 89 us at 128 (benchmarks/NOTES.md)
DEFAULT_BLOCK_N = 64
WIDE_HEAD_BLOCK_N = 32  # head_dim above 128: half the keys per tile keep K/V tiles within shared memory (untuned)


def padded_head_dim(head_dim: int) -> int:
    """Tile width along head_dim: the next power of two, at least 16 (tl.dot's smallest K); the rest is masked."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def attend_kv_tile(
    q,  # [ROWS, DIM_PAD] query rows (zero in the padded dims), the dtype of the model
    m_i,  # [ROWS] fp32 running max of the log2-scaled scores
    l_i,  # [ROWS] fp32 running sum of exp2(score - m_i)
    acc,  # [ROWS, DIM_PAD] fp32 running sum of exp2(score - m_i) * value
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    tile_start,  # position of the tile's first key
    row_pos,  # [ROWS] position of each query row; a row sees keys at positions <= row_pos
    kv_end,  # keys at positions >= kv_end are never loaded
    scale_log2,  # softmax scale * log2(e)
    stride_cache_block,
    stride_cache_slot,  # = num_kv_heads * HEAD_DIM
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM (at least 16, for tl.dot)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False only when every key of the tile is visible to every row
    FP8: tl.constexpr,  # the cache holds float8 e4m3 with a power-of-two scale per (position, KV head)
    FP8_VIA_F16: tl.constexpr,  # FP8 only: q arrives as float16, both dots run in f16 (module docstring)
):
    """One online-softmax step: fold the keys [tile_start, tile_start + BLOCK_N) into (m_i, l_i, acc)."""
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, DIM_PAD)
    # Cache element (position p, kv_head, d) lives at block_table[p // BLOCK_SIZE] * stride_cache_block
    #   + (p % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM + d.
    if MASKED:
        load_mask = key_pos < kv_end
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=load_mask, other=0)
    else:
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)
    offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
    offsets = offsets[:, None] + kv_head * HEAD_DIM + dims[None, :]
    # Masked loads read zeros: keys past kv_end, and the padded dims when HEAD_DIM is not a power of two.
    if DIM_PAD != HEAD_DIM:
        if MASKED:
            kv_mask = load_mask[:, None] & (dims < HEAD_DIM)[None, :]
        else:
            kv_mask = (key_pos >= 0)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
    elif MASKED:
        k = tl.load(k_cache_ptr + offsets, mask=load_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=load_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)

    scores = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:  # scores and probabilities carry the keys' and values' scales: exact, they are powers of two
        # Scale (position p, kv_head) lives at block_table[p // BLOCK_SIZE] * (num_kv_heads * BLOCK_SIZE)
        #   + kv_head * BLOCK_SIZE + p % BLOCK_SIZE: one head's scales of a block are contiguous.
        scale_offsets = block_ids * (stride_cache_slot // HEAD_DIM * BLOCK_SIZE) + kv_head * BLOCK_SIZE
        scale_offsets += key_pos % BLOCK_SIZE
        if MASKED:
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=load_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=load_mask, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_offsets)
            v_scale = tl.load(v_scale_ptr + scale_offsets)
        scores = scores * (k_scale * scale_log2)[None, :]
    else:
        scores = scores * scale_log2
    if MASKED:
        scores = tl.where(key_pos[None, :] <= row_pos[:, None], scores, float("-inf"))
    # Invariant: the first tile a row folds in holds key 0, which every row sees, so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_VIA_F16:
        # p * v_scale can fall below f16's normal range (2^-14); p * (v_scale / max v_scale) lies in [0, 1] and the
        # largest scale multiplies the tile's sum instead. Both are powers of two: exact. A tile whose scales are all
        # 0 (slots never written: masked keys read 0, and so would a table pointing at unused blocks) adds nothing,
        # as on the other path, instead of 0 / 0.
        v_scale_max = tl.max(v_scale, 0)
        p = p * (v_scale / tl.where(v_scale_max > 0.0, v_scale_max, 1.0))[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype)) * v_scale_max
    else:
        if FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, TOKENS_PER_TILE: tl.constexpr):
    """Largest i with first_tile(i) <= tile, where first_tile(i) = query_start_loc[i] // TOKENS_PER_TILE + i.

    first_tile is strictly increasing and leaves room for every tile of sequence i before first_tile(i + 1),
    so the grid num_tokens // TOKENS_PER_TILE + num_seqs covers all sequences without knowing max_query_len.
    """
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // TOKENS_PER_TILE + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


# num_seqs changes every step: not specialised (Triton would compile separate variants for 1 and for multiples of
# 16, one of them inside a user's request); every other integer argument is fixed per model.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, num_kv_heads, BLOCK_SIZE] float32 (FP8 only)
    v_scale_ptr,
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_block_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
    FP8: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,
):
    # Heaviest tiles first: the last query tiles of a sequence attend to the most keys (causal), so launching the
    # grid in reverse order lets the light tiles fill the tail of the last wave.
    kv_head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, TOKENS_PER_TILE)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = (tile - (query_start // TOKENS_PER_TILE + seq)) * TOKENS_PER_TILE
    if first_token >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len  # positions already cached before this step

    rows = tl.arange(0, BLOCK_M)
    row_token = first_token + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS_PER_TILE * GROUP) & (row_token < query_len)
    row_pos = context_len + row_token
    dims = tl.arange(0, DIM_PAD)
    row_dim_valid = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    token_index = (query_start + row_token).to(tl.int64)
    q_offsets = token_index[:, None] * stride_query_token + row_head[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_dim_valid, other=0.0)
    if FP8_VIA_F16:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_block_table_seq
    # Keys [0, full_end) are visible to every row of the tile; keys [full_end, kv_end) need the causal mask;
    # keys >= kv_end are in the future of every row and are never loaded (causal tile skipping).
    first_pos = context_len + first_token
    kv_end = context_len + tl.minimum(first_token + TOKENS_PER_TILE, query_len)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
            tile_start, row_pos, kv_end, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
            BLOCK_SIZE, BLOCK_N, False, FP8, FP8_VIA_F16,
        )  # fmt: skip
    for tile_start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
            tile_start, row_pos, kv_end, scale_log2, stride_cache_block, stride_cache_slot, HEAD_DIM, DIM_PAD,
            BLOCK_SIZE, BLOCK_N, True, FP8, FP8_VIA_F16,
        )  # fmt: skip

    out = acc / l_i[:, None]
    o_offsets = token_index[:, None] * stride_out_token + row_head[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_dim_valid)


def dots_in_f16(fp8: bool, fp8_via_f16: bool, query_dtype: torch.dtype) -> bool:
    """Whether the kernels take the fp8 path with both dots in float16: when asked, and always for a float16 model,
    whose dots run in f16 anyway and need the tile-relative value scales (p * v_scale underflows f16 for small
    values; for such a model the conversion is otherwise the same)."""
    return fp8 and (fp8_via_f16 or query_dtype == torch.float16)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [num_blocks, num_kv_heads, block_size] float32: the cache is fp8
    v_scale: torch.Tensor | None = None,
    fp8_via_f16: bool = False,  # fp8 cache only: both dots in float16 (module docstring)
) -> torch.Tensor:
    """Causal attention of the packed queries of any lengths over each sequence's paged context."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = padded_head_dim(head_dim)
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_m >= group, "a tile must hold at least one token's query heads"
    fp8 = k_scale is not None
    assert not fp8 or (v_scale is not None and k_scale.is_contiguous() and v_scale.is_contiguous())
    assert fp8 or not fp8_via_f16, "fp8_via_f16 needs an fp8 cache"
    fp8_via_f16 = dots_in_f16(fp8, fp8_via_f16, query.dtype)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    tokens_per_tile = block_m // group
    grid = (num_kv_heads, num_tokens // tokens_per_tile + num_seqs)
    _prefill_attention_kernel[grid](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, out, query_start_loc,
        seq_lens, block_tables, num_seqs, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n or (DEFAULT_BLOCK_N if dim_pad <= 128 else WIDE_HEAD_BLOCK_N), TOKENS_PER_TILE=tokens_per_tile,
        FP8=fp8, FP8_VIA_F16=fp8_via_f16, num_warps=num_warps or (8 if block_m >= 128 or dim_pad > 128 else 4),
        num_stages=num_stages,
    )  # fmt: skip
    return out
