"""Triton attention kernels on a CUDA GPU: the correctness checks, then timings against the copy bandwidth measured
in the same run, for 16-bit and fp8 KV caches and head_dim 64/80/96/128.

Run on the GPU machine, from the repository root:
    PYTHONUNBUFFERED=1 python benchmarks/attention_kernels.py            # checks + timings (a few minutes)
    python benchmarks/attention_kernels.py --no-checks --quick           # timings of the main rows only
    python benchmarks/attention_kernels.py --no-checks --quick --fp8-sweep  # + the fp8 decode sweep (~1.5 min)
    python benchmarks/attention_kernels.py --no-checks --quick --splits-sweep  # + one-sequence splits, decode tiles
Writes $OUT/kernels.json (every number) and $OUT/kernels.md (the tables), OUT defaulting to the current directory,
after every section, so a run cut short keeps what it measured. The checks are `pytest -m gpu tests/kernels`.
On a CPU, `--dry-run` runs the sweeps' code paths on tiny shapes under the Triton interpreter (times meaningless).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels")]
from paged_batch import PagedBatch, Step, make_batch  # noqa: E402

from pagedllm.attention.fp8 import dequantize_fp8  # noqa: E402
from pagedllm.attention.torch_backend import paged_attention  # noqa: E402

DEVICE = "cuda"  # "cpu" with --dry-run
MODEL_DTYPE = "bfloat16"  # of the decode queries and the sweep's; "float16" with --dry-run (the interpreter's dots
# read bfloat16 as garbage: errors ~1e9, not a kernel bug; the interpreter tests use float32/float16 only)
QWEN3 = dict(num_heads=16, num_kv_heads=8, head_dim=128)  # Qwen3-0.6B attention, per layer
# Call 1 of the first kernels swept block_n {32, 64, 128} x warps {4, 8} x stages {2..5}: benchmarks/NOTES.md.
DECODE_CONFIGS = [
    dict(block_n=64, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=4),
    dict(block_n=128, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=8, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=3, num_splits=2),
]
# The fp8 decode sweep (--fp8-sweep): every combination, both conversions (benchmarks/NOTES.md, "GPU speed").
FP8_SWEEP_GRID = dict(block_n=(32, 64, 128, 256), num_warps=(4, 8), num_stages=(1, 2, 3, 4), fp8_via_f16=(False, True))
PREFILL_CONFIGS = [
    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=64, num_warps=4, num_stages=4),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
]


def bench_us(function) -> float:
    if DEVICE == "cpu":  # --dry-run: one interpreted call proves the path runs; its time means nothing
        start = time.perf_counter()
        function()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return do_bench(function, warmup=25, rep=200, return_mode="median") * 1e3


def copy_bandwidth(num_floats: int = 2**29) -> float:
    """Device-to-device copy of num_floats float32 (2 GiB by default), bytes read plus bytes written, per second."""
    source = torch.randn(num_floats, device=DEVICE)
    target = torch.empty_like(source)
    return 2 * source.nbytes / (bench_us(lambda: target.copy_(source)) * 1e-6)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    return error if math.isfinite(error) else float("inf")


def cache_bytes(batch: PagedBatch, num_positions: int) -> int:
    """K+V bytes (and fp8 scales) that attention over num_positions cached positions reads."""
    _, _, num_kv_heads, head_dim = batch.k_cache.shape
    per_head = head_dim * batch.k_cache.element_size() + (4 if batch.k_scale is not None else 0)
    return 2 * num_positions * num_kv_heads * per_head


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float32 torch attention over the cache as stored (fp8 dequantized exactly)."""
    k_cache, v_cache = batch.k_cache.float(), batch.v_cache.float()
    if batch.k_scale is not None:
        k_cache = dequantize_fp8(batch.k_cache, batch.k_scale.transpose(1, 2), torch.float32)
        v_cache = dequantize_fp8(batch.v_cache, batch.v_scale.transpose(1, 2), torch.float32)
    return paged_attention(batch.query.float(), k_cache, v_cache, batch.metadata, scale)


def decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, kv_cache_dtype, block_size=16) -> PagedBatch:
    step = Step((1,) * len(seq_lens), tuple(seq_lens), num_heads, num_kv_heads, head_dim, block_size, MODEL_DTYPE,
                kv_cache_dtype)  # fmt: skip
    return make_batch(step, torch.Generator().manual_seed(0), DEVICE, poison=False)


def time_decode(
    name: str,
    batch: PagedBatch,
    copy_bw: float,
    config: dict,
    graph: bool = False,
    expected: torch.Tensor | None = None,
) -> dict:
    """One row: median us of decode attention (a CUDA graph replay when graph), bandwidth, error against expected
    (the reference of this batch, computed here when not given)."""
    from pagedllm.kernels import decode_attention

    md, head_dim = batch.metadata, batch.query.shape[2]
    scale = head_dim**-0.5
    cache = "fp8" if batch.k_scale is not None else str(batch.k_cache.dtype).removeprefix("torch.")
    row = {"bench": name, "cache": cache, "head_dim": head_dim, "block_size": batch.k_cache.shape[1], **config}
    row["graph"] = graph
    try:
        out = torch.full_like(batch.query, float("nan"))
        run = partial(decode_attention, batch.query, batch.k_cache, batch.v_cache, md.seq_lens, md.block_tables,
                      scale, out, k_scale=batch.k_scale, v_scale=batch.v_scale, **config)  # fmt: skip
        run()
        row["rel_err"] = relative_error(out, reference(batch, scale) if expected is None else expected)
        if graph:
            torch.cuda.synchronize()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                run()
            run = cuda_graph.replay
        row["us"] = bench_us(run)
        kv_bytes = cache_bytes(batch, int(md.seq_lens.sum()))
        row["GB/s"] = kv_bytes / (row["us"] * 1e-6) / 1e9
        row["pct_of_copy"] = 100 * kv_bytes / (row["us"] * 1e-6) / copy_bw
    except Exception as error:  # a config can run out of shared memory: record it and go on
        row["error"] = repr(error)[:300]
    print(row, flush=True)
    return row


def decode_rows(copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    uniform = [1024] * 256
    for cache in ("auto", "fp8"):
        batch = decode_batch(uniform, **QWEN3, kv_cache_dtype=cache)
        name = "decode 256 x 1024, 16/8 heads"
        for config in DECODE_CONFIGS[:1] if quick else DECODE_CONFIGS:
            rows.append(time_decode(name, batch, copy_bw, config))
        rows.append(time_decode(name, batch, copy_bw, {}, graph=True))
        del batch
    for head_dim in (64, 80, 96):
        for cache in ("auto", "fp8"):
            batch = decode_batch(uniform, 16, 8, head_dim, cache)
            rows.append(time_decode("decode 256 x 1024, 16/8 heads", batch, copy_bw, {}, graph=True))
    mixed = torch.randint(100, 2049, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    for cache in ("auto", "fp8"):
        batch = decode_batch(mixed, **QWEN3, kv_cache_dtype=cache)
        rows.append(time_decode("decode 256 x 100..2048 (mixed), 16/8 heads", batch, copy_bw, {}, graph=True))
    for cache in ("auto", "fp8"):
        batch = decode_batch([4096] * 8, **QWEN3, kv_cache_dtype=cache)
        rows.append(time_decode("decode 8 x 4096, 16/8 heads", batch, copy_bw, {}, graph=True))
        if not quick:
            for config in ({}, dict(num_splits=1), dict(num_splits=4)):
                rows.append(time_decode("decode 8 x 4096, 16/8 heads", batch, copy_bw, config))
    if not quick:
        for cache in ("auto", "fp8"):
            batch = decode_batch(uniform, 16, 16, 128, cache)
            rows.append(time_decode("decode 256 x 1024, 16/16 heads (MHA)", batch, copy_bw, {}))
            batch = decode_batch(uniform, **QWEN3, kv_cache_dtype=cache, block_size=128)
            rows.append(time_decode("decode 256 x 1024, 16/8 heads", batch, copy_bw, {}))
        rows.append(varlen_decode_row(decode_batch(uniform, **QWEN3, kv_cache_dtype="auto"), copy_bw))
    return rows


def fp8_sweep_configs() -> list[dict]:
    """Every combination of FP8_SWEEP_GRID: block_n outermost, the conversion innermost (bf16 and f16 side by side)."""
    configs = [{}]
    for key, values in reversed(FP8_SWEEP_GRID.items()):
        configs = [{key: value, **config} for value in values for config in configs]
    return configs


def fp8_sweep_rows(copy_bw: float, shapes: dict, prefill_shape: tuple) -> list[dict]:
    """fp8 decode over FP8_SWEEP_GRID for each shape (name -> (seq_lens, heads as QWEN3)), after bf16 at its
    default; then prefill: bf16 and fp8 at their defaults, and fp8 with fp8_via_f16."""
    rows = []
    for name, (seq_lens, heads) in shapes.items():
        rows.append(time_decode(name, decode_batch(seq_lens, **heads, kv_cache_dtype="auto"), copy_bw, {}))
        batch = decode_batch(seq_lens, **heads, kv_cache_dtype="fp8")
        expected = reference(batch, heads["head_dim"] ** -0.5)  # once: every config must reproduce it
        for config in fp8_sweep_configs():
            rows.append(time_decode(name, batch, copy_bw, config, expected=expected))
        del batch, expected
    num_seqs, seq_len, num_kv_heads, head_dim = prefill_shape
    for cache, config in (("auto", {}), ("fp8", {}), ("fp8", dict(fp8_via_f16=True))):
        step = Step((seq_len,) * num_seqs, (seq_len,) * num_seqs, 16, num_kv_heads, head_dim, 16, MODEL_DTYPE, cache)
        batch = make_batch(step, torch.Generator().manual_seed(0), DEVICE, poison=False)
        rows.append(time_prefill(batch, config, varlen=False))
    return rows


def splits_sweep_rows(copy_bw: float, dry_run: bool) -> list[dict]:
    """Decode attention where the batch leaves the GPU short of programs or the kernel short of bandwidth: one
    sequence at bench --latency's two contexts (32,000 and 1,024 tokens; 16 splits by default) over num_splits, and
    TinyLlama-1.1B's heads (32 q / 4 KV, head_dim 64) at batch 256 on mixed lengths over tiles and splits."""
    qwen3, tinyllama = QWEN3, dict(num_heads=32, num_kv_heads=4, head_dim=64)
    if dry_run:
        qwen3, tinyllama = dict(qwen3, num_heads=4, num_kv_heads=2), dict(tinyllama, num_heads=8, num_kv_heads=1)
    graph = not dry_run
    rows = []
    for seq_len in (300, 40) if dry_run else (32000, 1024):
        batch = decode_batch([seq_len], **qwen3, kv_cache_dtype="auto")
        expected = reference(batch, qwen3["head_dim"] ** -0.5)
        for config in ({}, *(dict(num_splits=splits) for splits in (16, 32, 64, 128))):
            rows.append(time_decode(f"decode 1 x {seq_len}", batch, copy_bw, config, graph, expected))
        del batch, expected
    lengths = (40, 70, 55) if dry_run else torch.randint(100, 2049, (256,), generator=torch.Generator().manual_seed(0))
    batch = decode_batch(list(map(int, lengths)), **tinyllama, kv_cache_dtype="auto")
    expected = reference(batch, tinyllama["head_dim"] ** -0.5)
    configs = ({}, dict(block_n=32), dict(block_n=128), dict(num_warps=8), dict(num_splits=2), dict(num_splits=4))
    for config in configs:
        name = f"decode {len(lengths)} x mixed, {tinyllama['num_heads']}/{tinyllama['num_kv_heads']} heads, d64"
        rows.append(time_decode(name, batch, copy_bw, config, graph, expected))
    return rows


def fp8_sweep_shapes(dry_run: bool) -> tuple[dict, tuple]:
    """The sweep's decode shapes and its prefill shape (num_seqs, seq_len, num_kv_heads, head_dim): Qwen3-0.6B's
    heads at the benchmark's sizes, or tiny ones for the interpreter."""
    if dry_run:
        tiny = dict(num_heads=4, num_kv_heads=2, head_dim=128)
        return {"decode 3 x 40..70 (dry run), 4/2 heads": ((40, 70, 55), tiny)}, (2, 24, 2, 128)
    mixed = torch.randint(100, 2049, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    shapes = {
        "decode 256 x 1024, 16/8 heads": ([1024] * 256, QWEN3),
        "decode 256 x 100..2048 (mixed), 16/8 heads": (mixed, QWEN3),
    }
    return shapes, (4, 1024, 8, 128)


def try_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None


def varlen_decode_row(batch: PagedBatch, copy_bw: float) -> dict:
    """The same decode through torch's varlen_attn (flash-attention) over the paged cache, where it can."""
    md, scale = batch.metadata, batch.query.shape[2] ** -0.5
    row = {"bench": "decode 256 x 1024, torch varlen_attn (paged)", "cache": "bfloat16", "head_dim": 128}
    try:
        paged = dict(scale=scale, seqused_k=md.seq_lens, block_table=md.block_tables, enable_gqa=True)
        run = partial(try_varlen_attn(), batch.query, batch.k_cache, batch.v_cache, md.query_start_loc, None, 1,
                      md.max_seq_len, **paged)  # fmt: skip
        row["rel_err"] = relative_error(run(), reference(batch, scale))
        row["us"] = bench_us(run)
        row["pct_of_copy"] = 100 * cache_bytes(batch, int(md.seq_lens.sum())) / (row["us"] * 1e-6) / copy_bw
    except Exception as error:
        row["error"] = repr(error)[:300]
    print(row, flush=True)
    return row


def prefill_rows(quick: bool) -> list[dict]:
    """4 fresh sequences of 1024 tokens packed (16 query heads), and 2 x 4096; TFLOP/s of the causal attention."""
    rows = []
    shapes = [(4, 1024, 16, 128, "auto", PREFILL_CONFIGS[:1] if quick else PREFILL_CONFIGS)]
    shapes += [(4, 1024, 8, 128, "auto", [{}]), (4, 1024, 8, 128, "fp8", [{}]), (4, 1024, 16, 128, "fp8", [{}])]
    shapes += [(4, 1024, 8, head_dim, cache, [{}]) for head_dim in (64, 80, 96) for cache in ("auto", "fp8")]
    if not quick:
        shapes += [(2, 4096, 16, 128, "auto", [{}, PREFILL_CONFIGS[3]]), (2, 4096, 16, 128, "fp8", [{}])]
    for num_seqs, seq_len, num_kv_heads, head_dim, cache, configs in shapes:
        step = Step((seq_len,) * num_seqs, (seq_len,) * num_seqs, 16, num_kv_heads, head_dim, 16, "bfloat16", cache)
        batch = make_batch(step, torch.Generator().manual_seed(0), DEVICE, poison=False)
        for config in configs:
            rows.append(time_prefill(batch, config, varlen=False))
        if cache == "auto" and num_kv_heads == 16 and head_dim == 128 and not quick:
            rows.append(time_prefill(batch, {}, varlen=True))
    return rows


def time_prefill(batch: PagedBatch, config: dict, varlen: bool) -> dict:
    from pagedllm.kernels import prefill_attention, store_kv_cache

    md = batch.metadata
    num_seqs, seq_len = md.num_seqs, md.max_seq_len
    num_heads, head_dim = batch.query.shape[1:]
    scale = head_dim**-0.5
    cache = "fp8" if batch.k_scale is not None else str(batch.k_cache.dtype).removeprefix("torch.")
    name = f"prefill {num_seqs} x {seq_len}, {num_heads}/{batch.k_cache.shape[2]} heads" + (
        ", torch varlen_attn" if varlen else ""
    )
    row = {"bench": name, "cache": cache, "head_dim": head_dim, **config}
    try:
        scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
        store_kv_cache(batch.key, batch.value, batch.k_cache, batch.v_cache, md.slot_mapping, **scales)
        if varlen:
            key, value, cu = batch.key.contiguous(), batch.value.contiguous(), md.query_start_loc
            run = partial(try_varlen_attn(), batch.query, key, value, cu, cu, seq_len, seq_len, scale=scale,
                          **causal_kwargs())  # fmt: skip
        else:
            out = torch.empty_like(batch.query)
            run = partial(prefill_attention, batch.query, batch.k_cache, batch.v_cache, md.query_start_loc,
                          md.seq_lens, md.block_tables, scale, out, **scales, **config)  # fmt: skip
        result = run()
        row["rel_err"] = relative_error(result if varlen else out, reference(batch, scale))
        row["us"] = bench_us(run)
        flops = 4 * num_seqs * (seq_len * (seq_len + 1) // 2) * num_heads * head_dim
        row["TFLOP/s"] = flops / (row["us"] * 1e-6) / 1e12
    except Exception as error:
        row["error"] = repr(error)[:300]
    print(row, flush=True)
    return row


def causal_kwargs() -> dict:
    """varlen_attn's causal switch changed between releases: is_causal=True, later window_size=(-1, 0)."""
    import inspect

    params = inspect.signature(try_varlen_attn()).parameters
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def store_rows() -> list[dict]:
    """The KV store kernel for a decode step (256 tokens) and a prefill step (8192 tokens), 8 KV heads."""
    from pagedllm.kernels import store_kv_cache

    rows = []
    for num_tokens in (256, 8192):
        for head_dim in (128, 80):
            for cache in ("auto", "fp8"):
                step = Step((num_tokens,), (num_tokens,), 16, 8, head_dim, 16, "bfloat16", cache)
                batch = make_batch(step, torch.Generator().manual_seed(0), DEVICE, poison=False)
                row = {"bench": f"store {num_tokens} tokens, 8 KV heads", "cache": cache, "head_dim": head_dim}
                try:
                    scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
                    run = partial(store_kv_cache, batch.key, batch.value, batch.k_cache, batch.v_cache,
                                  batch.metadata.slot_mapping, **scales)  # fmt: skip
                    row["us"] = bench_us(run)
                except Exception as error:
                    row["error"] = repr(error)[:300]
                print(row, flush=True)
                rows.append(row)
    return rows


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled specialisation (Triton's per-device kernel caches)."""
    rows = []
    for module_name, kernel_name in (
        ("pagedllm.kernels.prefill_attention", "_prefill_attention_kernel"),
        ("pagedllm.kernels.decode_attention", "_decode_split_kernel"),
        ("pagedllm.kernels.kv_store", "_store_kv_kernel"),
    ):
        kernel = getattr(importlib.import_module(module_name), kernel_name)
        try:
            for cache in kernel.device_caches.values():
                for key, compiled in cache[0].items():
                    rows.append({"kernel": kernel_name, "key": str(key)[:300], "n_regs": compiled.n_regs,
                                 "n_spills": compiled.n_spills, "shared": compiled.metadata.shared})  # fmt: skip
        except Exception as error:
            rows.append({"kernel": kernel_name, "error": repr(error)[:300]})
    return rows


def run_checks(out_dir: Path) -> dict:
    """pytest -m gpu tests/kernels in a child process (its own compile caches); the summary and a junit file."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/kernels",
               f"--junitxml={out_dir / 'kernel_checks.xml'}"]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=420)
        tail = (proc.stdout + proc.stderr)[-6000:]
        result = {"returncode": proc.returncode, "summary": tail.strip().splitlines()[-1] if tail.strip() else ""}
        result["output_tail"] = tail
    except subprocess.TimeoutExpired as error:
        result = {"returncode": None, "summary": "timed out after 420 s", "output_tail": str(error.stdout)[-6000:]}
    result["seconds"] = time.perf_counter() - start
    print("checks:", result["summary"], flush=True)
    return result


COLUMNS = ("bench", "cache", "head_dim", "config", "us", "GB/s", "pct_of_copy", "TFLOP/s", "rel_err", "error")
CONFIG_KEYS = ("block_size", "block_m", "block_n", "num_warps", "num_stages", "num_splits", "fp8_via_f16", "graph")


def markdown(results: dict) -> str:
    lines = [f"# Attention kernels on {results.get('device')}", ""]
    lines.append(f"torch {results.get('torch')}, triton {results.get('triton')}, commit {results.get('commit')}")
    if "copy_GB/s" in results:
        lines.append(f"copy bandwidth (read + write): {results['copy_GB/s']:.0f} GB/s")
    if "checks" in results:
        lines.append(f"checks (`pytest -m gpu tests/kernels`): {results['checks']['summary']}")
    for section in ("decode", "prefill", "store", "fp8_sweep", "splits_sweep"):
        if section not in results:
            continue
        lines += ["", f"## {section}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for row in results[section]:
            config = ", ".join(f"{k}={row[k]}" for k in CONFIG_KEYS if row.get(k) not in (None, False))
            cells = [format_cell(row.get(column)) for column in COLUMNS[:3]] + [config]
            cells += [format_cell(row.get(column)) for column in COLUMNS[4:]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2e}" if value < 0.1 else f"{value:.1f}"
    return str(value).replace("|", "/")[:120]


def save(results: dict, out_dir: Path) -> None:
    (out_dir / "kernels.json").write_text(json.dumps(results, indent=1))
    (out_dir / "kernels.md").write_text(markdown(results))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except Exception:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-checks", action="store_true", help="skip pytest -m gpu tests/kernels")
    parser.add_argument("--quick", action="store_true", help="only the main rows (no config sweeps)")
    parser.add_argument("--fp8-sweep", action="store_true", help="also the fp8 decode sweep over FP8_SWEEP_GRID")
    parser.add_argument("--splits-sweep", action="store_true", help="also one-sequence and TinyLlama decode sweeps")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the sweeps, tiny shapes, Triton interpreter")
    args = parser.parse_args()
    global DEVICE, MODEL_DTYPE
    if args.dry_run:
        DEVICE, MODEL_DTYPE = "cpu", "float16"
        os.environ["TRITON_INTERPRET"] = "1"  # read when pagedllm.kernels is first imported, below
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_kernels.py needs a CUDA GPU (or --dry-run)")
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    device_name = "cpu (interpreter dry run)" if args.dry_run else torch.cuda.get_device_name()
    results = {"torch": torch.__version__, "triton": triton.__version__, "device": device_name,
               "commit": git_commit()}  # fmt: skip
    print(results, flush=True)
    if not args.no_checks and not args.dry_run:
        results["checks"] = run_checks(out_dir)
        save(results, out_dir)
    torch.manual_seed(0)
    results["copy_GB/s"] = copy_bandwidth(2**20 if args.dry_run else 2**29) / 1e9
    copy_bw = results["copy_GB/s"] * 1e9
    sections = {
        "decode": lambda: decode_rows(copy_bw, args.quick),
        "prefill": lambda: prefill_rows(args.quick),
        "store": store_rows,
        "fp8_sweep": lambda: fp8_sweep_rows(copy_bw, *fp8_sweep_shapes(args.dry_run)),
        "splits_sweep": lambda: splits_sweep_rows(copy_bw, args.dry_run),
        "kernel_resources": kernel_resources,
    }
    if args.dry_run:
        sections = {"fp8_sweep": sections["fp8_sweep"], "splits_sweep": sections["splits_sweep"]}
    else:
        if not args.fp8_sweep:
            del sections["fp8_sweep"]
        if not args.splits_sweep:
            del sections["splits_sweep"]
    for name, section in sections.items():
        try:
            results[name] = section()
        except Exception:
            results[name + "_error"] = traceback.format_exc()[-3000:]
            print(results[name + "_error"], flush=True)
        save(results, out_dir)
        if not args.dry_run:
            torch.cuda.empty_cache()
    print(markdown(results))
    if args.dry_run:  # the interpreter's results must match the reference like the GPU's (tolerance as the tests')
        rows = results.get("fp8_sweep", []) + results.get("splits_sweep", [])
        failed = [row for row in rows if not row.get("rel_err", float("inf")) < 1e-2]
        if failed or "fp8_sweep_error" in results or "splits_sweep_error" in results:
            raise SystemExit(f"dry run: {len(failed)} rows failed or erred")


if __name__ == "__main__":
    main()
