"""Where the fp8 decode kernel's time goes: variants of its tile step that change how the fp8 K/V tiles reach the
dot operands, against the production kernel, on the H200 (bf16 model, head_dim 128, fp8 cache, dots in f16).

The production kernel (pagedllm/kernels/decode_attention.py) takes 1.05x the bf16 kernel's time for half the bytes
(session 23). Its compiled TTGIR (Triton 3.9 for sm_90) moves K's fp8 tile to another register layout before the
conversion, and V's through shared memory as fp8; a bf16 tile goes global -> shared -> dot operand. Variants:
- scaled_k: K widened and multiplied by its scales in the load's layout (the scale no longer multiplies the scores),
  which may keep the conversion before the layout change, as a bf16 tile's;
- transposed: scores^T = K @ q^T, K the dot's first operand (its rows contiguous, no transpose), then
  acc^T = V^T @ P^T; the softmax runs along axis 0;
- both.

    python benchmarks/experiments/decode_fp8_layouts.py                       # GPU: checks and timings
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_fp8_layouts.py --dry-run   # CPU: the checks
    LAYOUT_VARIANTS=fp8_dots python benchmarks/experiments/decode_fp8_layouts.py      # session 29's fp8 x fp8 dots
    LAYOUT_VARIANTS=in_flight python benchmarks/experiments/decode_fp8_layouts.py     # session 29's tiles and stages
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_fma import sweep  # noqa: E402


@triton.jit
def _fp8_decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, stride_query_token, stride_query_head, stride_out_token, stride_out_head, stride_cache_block,
    stride_cache_slot, stride_block_table_seq, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALED_K: tl.constexpr, TRANSPOSED: tl.constexpr,
    FP8_DOTS: tl.constexpr, IGNORE_SCALES: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, KV head) over its whole context (no splits: 256 rows fill the GPU). HEAD_DIM is a
    # power of two here; the query rows are padded to ROWS >= 16 for tl.dot.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = seq.to(tl.int64) * stride_query_token + (kv_head * GROUP + rows)[:, None] * stride_query_head
    q = tl.load(query_ptr + q_offsets + dims[None, :], mask=row_valid[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if TRANSPOSED:
        acc = tl.zeros([HEAD_DIM, ROWS], dtype=tl.float32)
        q_t = tl.trans(q)
    else:
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    if FP8_DOTS:  # the query rounded to e4m3 with a scale per row (448: e4m3's largest), for fp8 x fp8 dots
        q_amax = tl.max(tl.abs(q.to(tl.float32)), 1)
        q_scale = tl.where(q_amax > 0.0, q_amax / 448.0, 1.0)
        q8 = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(0, tl.cdiv(seq_len, BLOCK_N)):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < seq_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
        kv_ptrs = offsets[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
        scale_offsets = block_ids * (stride_cache_slot // HEAD_DIM * BLOCK_SIZE) + kv_head * BLOCK_SIZE
        scale_offsets += key_pos % BLOCK_SIZE
        if IGNORE_SCALES:  # a timing probe only (wrong outputs): what the scales' loads cost
            k_scale = tl.where(key_valid, 1.0, 0.0)
            v_scale = tl.where(key_valid, 1.0, 0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
        if SCALED_K:  # the scales are powers of two and |k| <= 448: f16 holds k * scale while scale >= 2^-15
            k16 = (k.to(tl.float32) * k_scale[:, None]).to(tl.float16)
            key_factor = tl.zeros([BLOCK_N], dtype=tl.float32) + scale_log2
        else:
            k16 = k.to(tl.float16)
            key_factor = k_scale * scale_log2
        v_scale_max = tl.max(v_scale, 0)
        v_factor = v_scale / tl.where(v_scale_max > 0.0, v_scale_max, 1.0)  # in [0, 1]: p * v_factor stays in f16
        if TRANSPOSED:
            scores = tl.dot(k16, q_t) * key_factor[:, None]  # [BLOCK_N, ROWS]
            scores = tl.where(key_valid[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 0))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(scores - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            p = p * v_factor[:, None]
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16)) * v_scale_max
        else:
            if FP8_DOTS:  # 1: the scores' dot on fp8 operands as stored (no widening of K); 2: both dots
                scores = tl.dot(q8, tl.trans(k)) * (q_scale[:, None] * key_factor[None, :])
            else:
                scores = tl.dot(q, tl.trans(k16)) * key_factor[None, :]  # [ROWS, BLOCK_N]
            scores = tl.where(key_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p * v_factor[None, :]
            if FP8_DOTS == 2:  # noqa: SIM108 (a constexpr branch)
                values = tl.dot(p.to(tl.float8e4nv), v)
            else:
                values = tl.dot(p.to(tl.float16), v.to(tl.float16))
            acc = acc * alpha[:, None] + values * v_scale_max
        m_i = m_new
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out_offsets = seq.to(tl.int64) * stride_out_token + (kv_head * GROUP + rows)[:, None] * stride_out_head
    out_offsets += dims[None, :]
    if TRANSPOSED:  # noqa: SIM108 (a constexpr branch)
        out = tl.trans(acc / safe_l[None, :])
    else:
        out = acc / safe_l[:, None]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def fp8_decode(query, k_cache, v_cache, seq_lens, block_tables, scale, out, k_scale=None, v_scale=None,
               block_n=128, num_warps=4, num_stages=3, scaled_k=False, transposed=False, fp8_dots=0,
               ignore_scales=False):  # fmt: skip
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    _fp8_decode_kernel[(num_seqs, num_kv_heads)](
        query, k_cache, v_cache, k_scale, v_scale, out, seq_lens, block_tables, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SCALED_K=scaled_k, TRANSPOSED=transposed, FP8_DOTS=fp8_dots, IGNORE_SCALES=ignore_scales,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


VARIANTS = [
    dict(),
    dict(scaled_k=True),
    dict(transposed=True),
    dict(scaled_k=True, transposed=True),
    dict(transposed=True, block_n=64),
    dict(scaled_k=True, block_n=64),
    dict(scaled_k=True, transposed=True, block_n=64),
    dict(transposed=True, num_warps=8),
]
# session 29: both dots on fp8 operands (the query rounded to e4m3), against the stand-alone kernel's f16 dots
FP8_DOT_VARIANTS = [
    dict(),
    dict(fp8_dots=1),
    dict(fp8_dots=2),
    dict(fp8_dots=2, block_n=64),
    dict(fp8_dots=2, num_warps=8),
    dict(fp8_dots=1, block_n=64),
]
# session 29: more fp8 bytes in flight a program (a tile is half a bf16 tile's bytes): larger tiles, more stages
IN_FLIGHT_VARIANTS = [
    dict(),
    dict(num_stages=4),
    dict(num_stages=5),
    dict(block_n=256, num_stages=2),
    dict(block_n=256, num_stages=3),
    dict(block_n=256, num_warps=8, num_stages=3),
]
# session 29: the same kernel without loading the scales (outputs wrong: a timing probe)
PROBE_VARIANTS = [dict(), dict(ignore_scales=True), dict(ignore_scales=True, fp8_dots=2)]


def layout_variants(cache: str, dry_run: bool) -> list:
    from pagedllm.kernels import decode_attention

    sets = {"fp8_dots": FP8_DOT_VARIANTS, "in_flight": IN_FLIGHT_VARIANTS, "probe": PROBE_VARIANTS}
    chosen = sets.get(os.environ.get("LAYOUT_VARIANTS"), VARIANTS)
    extra = [("layout", fp8_decode, variant) for variant in chosen] if cache == "fp8" else []
    return [("production", decode_attention, {})] + extra


if __name__ == "__main__":
    # head_dim must be a power of two here: the d80 dry-run shape and Llama-3.2-1B's are left out (the latter to
    # keep the call short; TinyLlama has the same head size).
    sweep(layout_variants, "decode_fp8_layouts.json", skip_shapes=("dry 2 x 30", "Llama-3.2-1B"))
