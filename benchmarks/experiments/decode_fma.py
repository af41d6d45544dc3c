"""Decode attention without tensor cores for small GQA groups, against the tl.dot kernel, on the H200.

The tl.dot kernel (pagedllm/kernels/decode_attention.py) pads a KV head's query heads to 16 rows: at Qwen3's group
of 2, 14 of 16 rows are padding, and each K/V tile goes through shared memory into the dot operand layout (an fp8
tile is converted there too). Here each tile is loaded to registers, widened to float32, and multiplied in with
plain FMAs: group * 2 FMAs per cached element, so about 2 * group FMAs per 4 bytes (bf16 K+V).
Counting for Qwen3-0.6B at 256 x 1024 tokens, one layer: 537 MB of bf16 K+V (~112 us at the ~4.8 TB/s copy rate)
and 0.54 GFMA (~16 us at 33.5 TFMA/s): a group of 2 stays bound by bytes; a group of 8 (TinyLlama) is ~64 us of FMAs.

    python benchmarks/experiments/decode_fma.py            # GPU: checks, then the timing table
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_fma.py --dry-run   # CPU: the checks on tiny shapes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]


def load_attention_kernels():
    spec = importlib.util.spec_from_file_location("attention_kernels", ROOT / "benchmarks" / "attention_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_kernels"] = module
    spec.loader.exec_module(module)
    return module


@triton.jit
def _decode_fma_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, partial_out_ptr, partial_lse_ptr,
    seq_lens_ptr, block_tables_ptr, scale_log2,
    stride_query_token, stride_query_head, stride_partial_seq, stride_partial_head, stride_partial_split,
    stride_cache_block, stride_cache_slot, stride_block_table_seq,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, STORE_LSE: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
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
    dim_valid = dims < HEAD_DIM
    row_dim_valid = row_valid[:, None] & dim_valid[None, :]
    q_offsets = seq.to(tl.int64) * stride_query_token + row_head[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_dim_valid, other=0.0).to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq
    for tile in range(tile_begin, tile_end):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < seq_len
        block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offsets = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM
        kv_ptrs = offsets[:, None] + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [ROWS, BLOCK_N]
        if FP8:
            scale_offsets = block_ids * (stride_cache_slot // HEAD_DIM * BLOCK_SIZE) + kv_head * BLOCK_SIZE
            scale_offsets += key_pos % BLOCK_SIZE
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            scores = scores * (k_scale * scale_log2)[None, :]
        else:
            scores = scores * scale_log2
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile holds at least one valid key
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
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


def decode_attention_fma(query, k_cache, v_cache, seq_lens, block_tables, scale, out=None, num_splits=None,
                         block_n=32, num_warps=4, num_stages=2, k_scale=None, v_scale=None):  # fmt: skip
    from pagedllm.kernels.decode_attention import _decode_reduce_kernel, default_num_splits
    from pagedllm.kernels.prefill_attention import padded_head_dim

    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    dim_pad = padded_head_dim(head_dim)
    out = torch.empty_like(query) if out is None else out
    num_splits = num_splits or default_num_splits(num_seqs, num_kv_heads, query.device)
    if num_splits == 1:
        partial_out, partial_lse = out.unsqueeze(2), out
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    fp8 = k_scale is not None
    _decode_fma_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, partial_out, partial_lse,
        seq_lens, block_tables, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, ROWS=triton.next_power_of_2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, STORE_LSE=num_splits > 1, FP8=fp8, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


FMA_CONFIGS = [
    dict(block_n=16, num_warps=4, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=3),
    dict(block_n=32, num_warps=8, num_stages=2),
    dict(block_n=64, num_warps=4, num_stages=2),
    dict(block_n=64, num_warps=8, num_stages=2),
    dict(block_n=64, num_warps=8, num_stages=3),
    dict(block_n=128, num_warps=8, num_stages=2),
]


def run_one(ak, batch, kernel, config, copy_bw, expected, dry_run):
    md, head_dim = batch.metadata, batch.query.shape[2]
    row = dict(config)
    try:
        out = torch.full_like(batch.query, float("nan"))
        run = partial(kernel, batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables,
                      head_dim**-0.5, out, k_scale=batch.k_scale, v_scale=batch.v_scale, **config)  # fmt: skip
        run()
        row["rel_err"] = ak.relative_error(out, expected)
        if not dry_run:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            run = graph.replay
        row["us"] = ak.bench_us(run)
        row["pct_of_copy"] = 100 * ak.cache_bytes(batch, int(md.seq_lens.sum())) / (row["us"] * 1e-6) / copy_bw
    except Exception as error:
        row["error"] = repr(error)[:300]
    return row


QWEN3, QWEN3_8B = dict(num_heads=16, num_kv_heads=8, head_dim=128), dict(num_heads=32, num_kv_heads=8, head_dim=128)
LLAMA32_1B, TINYLLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=64), dict(num_heads=32, num_kv_heads=4, head_dim=64)


def shapes(dry_run: bool, skip: tuple[str, ...] = ()) -> dict:
    """name -> (seq_lens, heads): 256 decode rows of each model's attention (or tiny ones for the interpreter)."""
    if dry_run:
        every = {"dry 3 x 20..150, 4/2 d64": ((20, 150, 33), dict(num_heads=4, num_kv_heads=2, head_dim=64)),
                "dry 2 x 30, 8/1 d80": ((30, 17), dict(num_heads=8, num_kv_heads=1, head_dim=80))}  # fmt: skip
    else:
        mixed = torch.randint(100, 2049, (256,), generator=torch.Generator().manual_seed(0)).tolist()
        every = {
            "Qwen3-0.6B 16/8 d128, 256 x 1024": ([1024] * 256, QWEN3),
            "Qwen3-0.6B 16/8 d128, 256 mixed": (mixed, QWEN3),
            "Qwen3-8B 32/8 d128, 256 mixed": (mixed, QWEN3_8B),
            "Llama-3.2-1B 32/8 d64, 256 mixed": (mixed, LLAMA32_1B),
            "TinyLlama 32/4 d64, 256 mixed": (mixed, TINYLLAMA),
        }
    return {name: shape for name, shape in every.items() if not name.startswith(skip)}


def sweep(variants, out_name: str, skip_shapes: tuple[str, ...] = ()) -> None:
    """Every (kind, kernel, config) of variants(cache) on every shape, bf16 and fp8 caches, checked against the
    float32 reference and timed as CUDA-graph replays; $OUT/out_name holds every row, a table is printed last.
    --dry-run: the Triton interpreter on tiny shapes (times meaningless)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    dry_run = parser.parse_args().dry_run
    ak = load_attention_kernels()
    if dry_run:
        ak.DEVICE, ak.MODEL_DTYPE = "cpu", "float16"
    copy_bw = 1.0 if dry_run else ak.copy_bandwidth()
    results = []
    for name, (seq_lens, heads) in shapes(dry_run, skip_shapes).items():
        for cache in ("auto", "fp8"):
            batch = ak.decode_batch(seq_lens, **heads, kv_cache_dtype=cache)
            expected = ak.reference(batch, heads["head_dim"] ** -0.5)
            for kind, kernel, config in variants(cache, dry_run):
                row = {"shape": name, "cache": cache, "kernel": kind}
                row.update(run_one(ak, batch, kernel, config, copy_bw, expected, dry_run))
                print(row, flush=True)
                results.append(row)
            del batch, expected
    (Path(os.environ.get("OUT", ".")) / out_name).write_text(json.dumps(results, indent=1))
    print("\n| shape | cache | kernel | variant | us | % of copy | rel err |\n|---|---|---|---|---|---|---|")
    for row in results:
        variant = {k: v for k, v in row.items() if k not in ("shape", "cache", "kernel", "us", "pct_of_copy",
                                                              "rel_err", "error")}  # fmt: skip
        cells = f"error: {row['error'][:80]} ||" if "error" in row else (
            f"{row['us']:.1f} | {row['pct_of_copy']:.0f} | {row['rel_err']:.1e}")  # fmt: skip
        print(f"| {row['shape']} | {row['cache']} | {row['kernel']} | {variant} | {cells} |")
    bad = [row for row in results if "error" in row or row["rel_err"] > 2e-2]
    print(f"\n{len(bad)} rows failed or exceeded rel_err 2e-2")


def fma_variants(cache: str, dry_run: bool) -> list:
    from pagedllm.kernels import decode_attention

    configs = FMA_CONFIGS[:2] if dry_run else FMA_CONFIGS
    return [("dot (default)", decode_attention, {})] + [("fma", decode_attention_fma, c) for c in configs]


if __name__ == "__main__":
    sweep(fma_variants, "decode_fma.json")
