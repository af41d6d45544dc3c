"""Decode attention with every KV head of a sequence in one program: the query heads packed into one tile.

The production kernel (pagedllm/kernels/decode_attention.py) runs a program per (sequence, KV head, split) whose
tile holds that KV head's query heads padded to 16 rows for tl.dot: 2 real rows of 16 for Qwen3-0.6B's 16/8 heads.
Its softmax, rescaling and conversions run on all 16 rows, and session 23 found the fp8 cache's kernel bound by that
per-tile work (1.05x the bf16 kernel's time for half the bytes).

Here a program takes all KV heads of a sequence (and a split of its context): the query is one [heads, kv_heads *
head_dim] tile in which query head i holds its vector in its KV head's columns and zeros elsewhere, so one dot
against a tile of whole cache slots ([keys, kv_heads * head_dim], contiguous in the cache) gives every head its own
scores, and the softmax runs once on rows that are all real. The values are folded in KV head by KV head: each
head's [keys, head_dim] slab times the probabilities with the other heads' rows zeroed. The dots do kv_heads times
the multiply-adds of one head's (the zeros), the same total as the production kernel's programs together; the
softmax work falls by 16 / group.

    python benchmarks/experiments/decode_packed_heads.py                       # GPU: checks and timings
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_packed_heads.py --dry-run   # CPU: the checks
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_fma import sweep  # noqa: E402


@triton.jit
def _packed_decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr,
    block_tables_ptr, scale_log2, stride_query_token, stride_query_head, stride_partial_seq, stride_partial_head,
    stride_partial_split, stride_cache_block, stride_cache_slot, stride_block_table_seq,
    GROUP: tl.constexpr, ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr, FP8: tl.constexpr, FP8_VIA_F16: tl.constexpr,
):  # fmt: skip
    # Program (seq, split) folds the split-th run of BLOCK_N-key tiles for every head. HEAD_DIM and KV_HEADS *
    # HEAD_DIM are powers of two here.
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, ROWS)
    row_valid = rows < NUM_HEADS
    row_kv = rows // GROUP
    cols = tl.arange(0, KV_HEADS * HEAD_DIM)
    col_kv = cols // HEAD_DIM
    dims = tl.arange(0, HEAD_DIM)
    q_mask = row_valid[:, None] & (col_kv[None, :] == row_kv[:, None])
    q_offsets = seq.to(tl.int64) * stride_query_token + rows[:, None] * stride_query_head + (cols % HEAD_DIM)[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
    if FP8_VIA_F16:
        q = q.to(tl.float16)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(tile_begin, tile_end):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < seq_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
        k = tl.load(k_cache_ptr + slots[:, None] + cols[None, :], mask=key_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)))  # [ROWS, BLOCK_N]: each row against its own KV head
        if FP8:  # scale (block, kv_head, offset) at block * KV_HEADS * BLOCK_SIZE + kv_head * BLOCK_SIZE + offset
            scale_offsets = block_ids[None, :] * (KV_HEADS * BLOCK_SIZE) + row_kv[:, None] * BLOCK_SIZE
            scale_offsets += (key_pos % BLOCK_SIZE)[None, :]
            scale_mask = row_valid[:, None] & key_valid[None, :]
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=scale_mask, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=scale_mask, other=0.0)
            scores = scores * (k_scale * scale_log2)
        else:
            scores = scores * scale_log2
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_VIA_F16:  # as attend_kv_tile: scales relative to the row's largest in the tile, which multiplies after
            v_scale_max = tl.max(v_scale, 1)
            p = p * (v_scale / tl.where(v_scale_max > 0.0, v_scale_max, 1.0)[:, None])
        elif FP8:
            p = p * v_scale
        p = p.to(q.dtype)
        tile_acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for head in tl.static_range(KV_HEADS):
            v = tl.load(v_cache_ptr + slots[:, None] + head * HEAD_DIM + dims[None, :], mask=key_valid[:, None],
                        other=0.0)  # fmt: skip
            tile_acc += tl.dot(tl.where((row_kv == head)[:, None], p, 0.0).to(q.dtype), v.to(q.dtype))
        if FP8_VIA_F16:
            tile_acc = tile_acc * v_scale_max[:, None]
        acc = acc * alpha[:, None] + tile_acc
        m_i = m_new

    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    partial_offsets = seq.to(tl.int64) * stride_partial_seq + rows * stride_partial_head + split * stride_partial_split
    tl.store(partial_out_ptr + partial_offsets[:, None] + dims[None, :], out.to(partial_out_ptr.dtype.element_ty),
             mask=row_valid[:, None])  # fmt: skip
    if STORE_LSE:
        lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_offsets // HEAD_DIM, lse, mask=row_valid)


def packed_decode(query, k_cache, v_cache, seq_lens, block_tables, scale, out, k_scale=None, v_scale=None,
                  block_n=32, num_warps=4, num_stages=2, num_splits=None, via_f16=None):  # fmt: skip
    from pagedllm.kernels.decode_attention import _decode_reduce_kernel, default_num_splits

    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fp8 = k_scale is not None
    via_f16 = fp8 and (query.dtype == torch.float16 or (via_f16 if via_f16 is not None else head_dim == 128))
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, 1, query.device)
    if num_splits == 1:
        partial_out, partial_lse = out.unsqueeze(2), out
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _packed_decode_kernel[(num_seqs, num_splits)](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, partial_out, partial_lse,
        seq_lens, block_tables, scale * 1.4426950408889634, query.stride(0), query.stride(1), partial_out.stride(0),
        partial_out.stride(1), partial_out.stride(2), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, ROWS=max(16, triton.next_power_of_2(num_heads)), NUM_HEADS=num_heads,
        KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        STORE_LSE=num_splits > 1, FP8=fp8, FP8_VIA_F16=via_f16, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=head_dim, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


CONFIGS = [
    dict(block_n=16, num_warps=4, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=2),
    dict(block_n=32, num_warps=8, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=8, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=2, num_splits=8),
    dict(block_n=32, num_warps=4, num_stages=2, via_f16=False),
]


def packed_variants(cache: str, dry_run: bool) -> list:
    from pagedllm.kernels import decode_attention

    configs = CONFIGS[:2] if dry_run else CONFIGS
    if cache != "fp8":
        configs = [c for c in configs if "via_f16" not in c]
    return [("production", decode_attention, {})] + [("packed", packed_decode, c) for c in configs]


if __name__ == "__main__":
    sweep(packed_variants, "decode_packed_heads.json", skip_shapes=("dry 2 x 30",))
