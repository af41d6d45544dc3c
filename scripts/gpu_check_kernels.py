"""GPU check and benchmark of the Triton attention kernels: every kernel against the torch reference, then timings.

Run on a CUDA machine: `PYTHONUNBUFFERED=1 python3 scripts/gpu_check_kernels.py`. Prints a table last and writes
every number to $OUT/kernel_results.json (or ./kernel_results.json when OUT is unset).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.torch_backend import paged_attention  # noqa: E402
from pagedllm.attention.torch_backend import store_kv_cache as reference_store  # noqa: E402
from pagedllm.kernels import decode_attention, prefill_attention, store_kv_cache  # noqa: E402

BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
TOLERANCE = 1e-2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script under TRITON_INTERPRET=1


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (a view of a packed qkv tensor, like key and value)
    key: torch.Tensor
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, poison=True, skip=()):
    """Blocks in random order. poison: the cache is NaN except the cached context, and block 0, which every unused
    block-table entry points to, is all NaN, so any read outside a sequence's context shows up as NaN."""
    random = lambda *shape: torch.randn(*shape, device=DEVICE).to(dtype)
    q_lens, s_lens = torch.tensor(query_lens), torch.tensor(seq_lens)
    num_seqs, num_tokens = len(seq_lens), int(q_lens.sum())
    blocks_per_seq = (s_lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + 1
    block_tables = torch.zeros(num_seqs, max(int(blocks_per_seq.max()), 1), dtype=torch.int32)
    block_tables[torch.arange(block_tables.shape[1])[None] < blocks_per_seq[:, None]] = (
        1 + torch.randperm(num_blocks - 1)
    ).int()

    # Every context position: its sequence, position, cache slot, and (for new tokens) packed token index.
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), s_lens)
    pos = torch.arange(int(s_lens.sum())) - torch.repeat_interleave(s_lens.cumsum(0) - s_lens, s_lens)
    slots = block_tables[seq_of, pos // block_size].long() * block_size + pos % block_size
    context_lens = (s_lens - q_lens)[seq_of]
    is_new = pos >= context_lens
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long)
    slot_mapping[(query_start_loc[seq_of] + pos - context_lens)[is_new]] = slots[is_new]
    cached = ~is_new
    for token in skip:  # K/V of a skipped token (slot -1) is already in the cache
        cached |= slots == slot_mapping[token]
        slot_mapping[token] = -1

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    new_cache = lambda: torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) if poison else random(*shape)
    k_cache, v_cache = new_cache(), new_cache()
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[cached].to(DEVICE)] = random(int(cached.sum()), *shape[2:])
    qkv = random(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc=query_start_loc.int().to(DEVICE),
        seq_lens=s_lens.int().to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_only=all(n == 1 for n in query_lens),
    )
    return PagedBatch(query, key, value, k_cache, v_cache, metadata)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return err if math.isfinite(err) else float("inf")


def check_batch(batch: PagedBatch, scale: float, num_splits: int | None = None) -> dict:
    """Store with the kernel (int32 slot_mapping for prefill) and compare the cache with the reference store; then
    attention into a NaN-poisoned output against the fp32 reference on the real (seq_len > 0) rows."""
    md = batch.metadata
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference_store(batch.key, batch.value, ref_k, ref_v, md.slot_mapping)
    slot_mapping = md.slot_mapping if md.decode_only else md.slot_mapping.int()
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, slot_mapping)
    cache_ok = torch.equal(batch.k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
    cache_ok &= torch.equal(batch.v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    ref = paged_attention(batch.query.float(), ref_k.nan_to_num().float(), ref_v.nan_to_num().float(), md, scale)
    out = torch.full_like(batch.query, float("nan"))
    if md.decode_only:
        decode_attention(
            batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, scale, out, num_splits
        )
    else:
        prefill_attention(
            batch.query, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale, out
        )
    real = md.seq_lens > 0 if md.decode_only else torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    return {
        "cache_ok": bool(cache_ok),
        "no_nan": not bool(out.isnan().any()),
        "padding_zero": bool((out[~real] == 0).all()),
        "rel_err": relative_error(out[real], ref[real]),
    }


def guarded(check, *args) -> dict:
    """A check that raises (a compile error, say) fails its record instead of ending the run."""
    try:
        return check(*args)
    except Exception:
        return {
            "cache_ok": False,
            "no_nan": False,
            "padding_zero": False,
            "rel_err": float("inf"),
            "error": traceback.format_exc()[-1500:],
        }


def check_combo(group: int, head_dim: int, block_size: int, dtype: torch.dtype) -> list[dict]:
    num_kv_heads = 2
    shape = (group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    # fresh 300, prefix hit 57 of 400, chunk 256 of 700, decode at 1000, fresh 1, fresh 129
    prefill = make_batch([300, 57, 256, 1, 1, 129], [300, 400, 700, 1000, 1, 129], *shape, skip=(3,))
    records = [{"kernel": "store+prefill", **guarded(check_batch, prefill, scale)}]
    seq_lens = torch.randint(1, 1500, (24,))
    seq_lens[[3, 17, 23]] = 0  # padding rows of a captured batch
    for num_splits in (None, 1, 5):
        decode = make_batch([1] * 24, seq_lens.tolist(), *shape)
        records.append(
            {"kernel": f"store+decode splits={num_splits}", **guarded(check_batch, decode, scale, num_splits)}
        )
    for record in records:
        record.update(group=group, head_dim=head_dim, block_size=block_size, dtype=str(dtype).split(".")[1])
        record["ok"] = (
            record["cache_ok"] and record["no_nan"] and record["padding_zero"] and record["rel_err"] < TOLERANCE
        )
    return records


def check_all() -> list[dict]:
    """Every group 1..8 with both head dims; block sizes and dtypes cycle so each pairs with several of each."""
    records = []
    for group in range(1, 9):
        for i, head_dim in enumerate((64, 128)):
            block_size, dtype = BLOCK_SIZES[(2 * group + i) % 5], DTYPES[(group + i) % 2]
            records += check_combo(group, head_dim, block_size, dtype)
            bad = [r for r in records[-4:] if not r["ok"]]
            worst = max(r["rel_err"] for r in records[-4:])
            status = f"FAIL {bad}" if bad else "ok"
            print(
                f"check group={group} head_dim={head_dim} block={block_size} {dtype}: max rel_err {worst:.2e} {status}"
            )
    return records


def check_decode_graph() -> dict:
    """Capture decode in a CUDA graph, change seq_lens and block tables in place, replay: must equal eager."""
    batch = make_batch([1] * 64, [700] * 50 + [0] * 14, 16, 8, 128, 16, torch.bfloat16, poison=False)
    md, scale = batch.metadata, 128**-0.5
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, scale, out)
    decode_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args)
    md.seq_lens.copy_(torch.randint(0, 701, md.seq_lens.shape, device=DEVICE).int())
    md.block_tables.copy_(md.block_tables[torch.randperm(64, device=DEVICE)])
    graph.replay()
    eager = decode_attention(*args[:6])
    torch.cuda.synchronize()
    return {"graph_replay_matches_eager": bool(torch.equal(out, eager)), "no_nan": not bool(out.isnan().any())}


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written, in bytes per second."""
    src = torch.randn(2**29, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def try_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None


DECODE_SHAPE = (256, 1024, 16, 8, 128)  # batch, context, query heads, KV heads, head_dim
PREFILL_SHAPE = (4, 1024, 16, 128)  # sequences, tokens each, query heads, head_dim
BENCH_DTYPE = torch.bfloat16
# Call 1 swept block_n {32, 64, 128} x warps {4, 8} x stages {2..5} x splits {1, 2, 4}: see benchmarks/NOTES.md.
DECODE_CONFIGS = [
    dict(block_n=64, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=4),
    dict(block_n=128, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=3, num_splits=2),
]
SMALL_BATCH_CONFIGS = [{}, dict(num_splits=1), dict(num_splits=4)]


def bench_decode(copy_bw: float, block_size: int, configs: list[dict], shape=DECODE_SHAPE) -> list[dict]:
    """Default shape, Qwen3-0.6B attention per layer: batch 256 at context 1024, 16 query heads, 8 KV heads,
    head_dim 128, bf16."""
    batch_size, context, num_heads, num_kv_heads, head_dim = shape
    batch = make_batch(
        [1] * batch_size,
        [context] * batch_size,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        BENCH_DTYPE,
        poison=False,
    )
    md, scale = batch.metadata, head_dim**-0.5
    kv_bytes = 2 * batch_size * context * num_kv_heads * head_dim * 2
    ref = paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(), md, scale)
    decode_args = (batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, scale)
    rows = []
    for config in configs:
        out = torch.full_like(batch.query, float("nan"))
        run = partial(decode_attention, *decode_args, out, **config)
        row = {"bench": f"decode batch={batch_size} ctx={context} kv_heads={num_kv_heads}", "block_size": block_size}
        row.update(config)
        try:
            run()
            row["rel_err"] = relative_error(out, ref)
            row["us"] = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
            row["GB/s"] = kv_bytes / (row["us"] * 1e-6) / 1e9
            row["pct_of_copy"] = 100 * kv_bytes / (row["us"] * 1e-6) / copy_bw
        except Exception as error:  # a config can run out of shared memory: record it and go on
            row["error"] = repr(error)[:300]
        print(row)
        rows.append(row)
    if DEVICE == "cuda":
        rows.append(bench_decode_graph(batch, scale, kv_bytes, copy_bw, block_size))
    rows.append(bench_varlen_decode(batch, scale, kv_bytes, copy_bw, ref, block_size))
    return rows


def bench_decode_graph(batch: PagedBatch, scale: float, kv_bytes: int, copy_bw: float, block_size: int) -> dict:
    md = batch.metadata
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables, scale, out)
    decode_attention(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args)
    us = do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
    row = {"bench": "decode default, CUDA graph replay", "block_size": block_size, "us": us}
    row.update({"GB/s": kv_bytes / (us * 1e-6) / 1e9, "pct_of_copy": 100 * kv_bytes / (us * 1e-6) / copy_bw})
    print(row)
    return row


def bench_varlen_decode(batch, scale, kv_bytes, copy_bw, ref, block_size) -> dict:
    """The same decode through torch's varlen_attn (flash-attention) over the same paged cache, if it can."""
    batch_size, num_kv_heads = batch.query.shape[0], batch.k_cache.shape[2]
    name = (
        f"decode torch varlen_attn (paged) batch={batch_size} ctx={batch.metadata.max_seq_len} kv_heads={num_kv_heads}"
    )
    row = {"bench": name, "block_size": block_size}
    md, varlen_attn = batch.metadata, try_varlen_attn()
    try:
        cu_q = md.query_start_loc
        paged = dict(scale=scale, seqused_k=md.seq_lens, block_table=md.block_tables)
        if batch.query.shape[1] != batch.k_cache.shape[2]:
            paged["enable_gqa"] = True
        run = partial(varlen_attn, batch.query, batch.k_cache, batch.v_cache, cu_q, None, 1, md.max_seq_len, **paged)
        row["rel_err"] = relative_error(run(), ref)
        row["us"] = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
        row["pct_of_copy"] = 100 * kv_bytes / (row["us"] * 1e-6) / copy_bw
    except Exception as error:
        row["error"] = repr(error)[:300]
    print(row)
    return row


PREFILL_CONFIGS = [
    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=64, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
]


def bench_prefill(num_kv_heads: int, configs: list[dict], shape=PREFILL_SHAPE) -> list[dict]:
    """Default shape: 4 fresh sequences of 1024 tokens packed (4096 causal tokens), 16 query heads, head_dim 128,
    bf16, block size 16."""
    num_seqs, seq_len, num_heads, head_dim = shape
    batch = make_batch(
        [seq_len] * num_seqs, [seq_len] * num_seqs, num_heads, num_kv_heads, head_dim, 16, BENCH_DTYPE, poison=False
    )
    md, scale = batch.metadata, head_dim**-0.5
    store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, md.slot_mapping)
    flops = 4 * num_seqs * (seq_len * (seq_len + 1) // 2) * num_heads * head_dim
    ref = paged_attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(), md, scale)
    prefill_args = (batch.query, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale)
    rows = []
    for config in configs:
        out = torch.full_like(batch.query, float("nan"))
        run = partial(prefill_attention, *prefill_args, out, **config)
        rows.append(
            time_prefill(f"prefill triton {num_seqs}x{seq_len} kv_heads={num_kv_heads}", run, out, ref, flops, config)
        )
    varlen_attn = try_varlen_attn()
    if varlen_attn is not None:
        key, value = batch.key.contiguous(), batch.value.contiguous()
        cu, n = md.query_start_loc, seq_len
        causal = causal_kwargs(num_heads != num_kv_heads)
        run = partial(varlen_attn, batch.query, key, value, cu, cu, n, n, scale=scale, **causal)
        rows.append(
            time_prefill(
                f"prefill torch varlen_attn {num_seqs}x{seq_len} kv_heads={num_kv_heads}", run, None, ref, flops, {}
            )
        )
    return rows


def causal_kwargs(gqa: bool) -> dict:
    """varlen_attn's causal switch changed between releases: is_causal=True, later window_size=(-1, 0)."""
    import inspect

    params = inspect.signature(try_varlen_attn()).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return {**kwargs, "enable_gqa": True} if gqa else kwargs


def time_prefill(name: str, run, out, ref, flops: int, config: dict) -> dict:
    row = {"bench": name, **config}
    try:
        result = run()
        row["rel_err"] = relative_error(result if out is None else out, ref)
        row["us"] = do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
        row["TFLOP/s"] = flops / (row["us"] * 1e-6) / 1e12
    except Exception as error:
        row["error"] = repr(error)[:300]
    print(row)
    return row


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled specialisation (Triton's per-device kernel caches)."""
    decode_module = importlib.import_module("pagedllm.kernels.decode_attention")
    prefill_module = importlib.import_module("pagedllm.kernels.prefill_attention")
    rows = []
    for kernel in (prefill_module._prefill_attention_kernel, decode_module._decode_split_kernel):
        try:
            for cache in kernel.device_caches.values():
                for key, compiled in cache[0].items():
                    rows.append(
                        {
                            "kernel": kernel.__name__,
                            "key": str(key)[:300],
                            "n_regs": compiled.n_regs,
                            "n_spills": compiled.n_spills,
                            "shared": compiled.metadata.shared,
                        }
                    )
        except Exception as error:
            rows.append({"kernel": kernel.__name__, "error": repr(error)[:300]})
    return rows


def print_table(results: dict) -> None:
    print("\n== summary ==")
    print(f"copy bandwidth (read+write): {results['copy_GB/s']:.0f} GB/s")
    checks = results["checks"]
    print(
        f"checks: {sum(r['ok'] for r in checks)}/{len(checks)} ok, max rel_err {max(r['rel_err'] for r in checks):.2e}"
    )
    print(f"decode CUDA graph replay matches eager: {results['graph_check']}")
    print(f"{'bench':60} {'config':75} {'us':>8} {'%copy':>6} {'TFLOP/s':>8} {'rel_err':>8}")
    for row in results["decode"] + results["prefill"]:
        config = {
            k: v
            for k, v in row.items()
            if k in ("block_size", "block_m", "block_n", "num_warps", "num_stages", "num_splits")
        }
        cells = [row.get("us"), row.get("pct_of_copy"), row.get("TFLOP/s"), row.get("rel_err")]
        text = " ".join(
            f"{c:8.1f}" if isinstance(c, float) and c > 0.1 else f"{c:8.1e}" if c else f"{'-':>8}" for c in cells
        )
        print(f"{row['bench']:60} {str(config)[1:-1]:75} {text}", row.get("error", "")[:80])


def main() -> None:
    torch.manual_seed(0)
    out_dir = Path(os.environ.get("OUT", "."))
    import triton

    results = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    print(results)
    results["copy_GB/s"] = copy_bandwidth() / 1e9
    results["checks"] = check_all()
    try:
        results["graph_check"] = check_decode_graph()
    except Exception:
        results["graph_check"] = {"error": traceback.format_exc()[-1500:]}
    print("decode CUDA graph check:", results["graph_check"])
    copy_bw = results["copy_GB/s"] * 1e9
    results["decode"] = bench_decode(copy_bw, 16, DECODE_CONFIGS) + bench_decode(copy_bw, 128, DECODE_CONFIGS[:1])
    results["decode"] += bench_decode(copy_bw, 16, SMALL_BATCH_CONFIGS, shape=(8, 4096, 16, 8, 128))
    results["decode"] += bench_decode(copy_bw, 16, DECODE_CONFIGS[:1], shape=(256, 1024, 16, 16, 128))
    results["prefill"] = bench_prefill(16, PREFILL_CONFIGS) + bench_prefill(8, PREFILL_CONFIGS[:1])
    results["prefill"] += bench_prefill(16, PREFILL_CONFIGS[:1] + PREFILL_CONFIGS[5:7], shape=(2, 4096, 16, 128))
    try:
        results["kernel_resources"] = kernel_resources()
    except Exception:
        results["kernel_resources"] = traceback.format_exc()
    (out_dir / "kernel_results.json").write_text(json.dumps(results, indent=1))
    print_table(results)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
