"""The grouped-integer product (layers/quantization/cpu_grouped_gemm.cpp) of two commits in one process: each
commit's source built as its own library (cpu_attention_ab.build_ops: its op namespace renamed), then both timed
alternately on the default model's shapes, 4-bit groups for the 30 layers' four projections (each layer's weights
its own, so they come from memory as in an engine step) and 8-bit groups for the vocabulary head, at M rows.
    python benchmarks/experiments/cpu_grouped_gemm_ab.py --old HEAD [--new WORKTREE] [--threads 2] [--rounds 7]
Prints each commit's median time a step's products (layers, head) at each M, the paired speedup, and the largest
relative difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_attention_ab import build_ops  # noqa: E402

SOURCES = ("pagedllm/layers/quantization/cpu_grouped_gemm.cpp", "pagedllm/cpu_kernels.h")
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
HEAD_SHAPE = (49152, 576)
LAYERS = 30


def build(commit: str, tag: str, into: Path):
    """The commit's kernel; returns its (int4, int8) ops."""
    ops = build_ops(commit, tag, into, SOURCES)
    return ops.grouped_int4_mm.default, ops.grouped_int8_mm.default


def weights(n: int, k: int, bits: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=generator)
    scales = torch.rand(n, 2, k // 32, generator=generator) * 0.01
    return values, scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default="WORKTREE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"old": build(args.old, "old", Path(folder)), "new": build(args.new, "new", Path(folder))}
    generator = torch.Generator().manual_seed(0)
    layers = [{name: weights(*shape, 4, generator) for name, shape in LAYER_SHAPES.items()} for _ in range(LAYERS)]
    head = weights(*HEAD_SHAPE, 8, generator)

    def step(kernel, xs) -> tuple[float, float, list[torch.Tensor]]:
        int4, int8 = kernel
        outputs = []
        start = time.perf_counter()
        for layer in layers:
            for name, (values, scales) in layer.items():
                outputs.append(int4(xs[name], values, scales))
        middle = time.perf_counter()
        outputs.append(int8(xs["head"], *head))
        return middle - start, time.perf_counter() - middle, outputs

    print(f"{args.threads} threads; old {args.old}, new {args.new}; medians of {args.rounds} rounds, ms a step")
    print("| rows | old layers | new layers | speedup | old head | new head | speedup | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        xs = {name: torch.randn(rows, k, generator=generator) for name, (_, k) in LAYER_SHAPES.items()}
        xs["head"] = torch.randn(rows, HEAD_SHAPE[1], generator=generator)
        times = {tag: ([], []) for tag in kernels}
        for _ in range(args.rounds):
            results = {}
            for tag, kernel in kernels.items():
                layer_s, head_s, results[tag] = step(kernel, xs)
                times[tag][0].append(layer_s)
                times[tag][1].append(head_s)
        diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results["old"], results["new"]))
        old_l, new_l, old_h, new_h = (statistics.median(times[t][i]) * 1e3 for t, i in
                                      (("old", 0), ("new", 0), ("old", 1), ("new", 1)))  # fmt: skip
        print(f"| {rows} | {old_l:.2f} | {new_l:.2f} | {old_l / new_l:.2f}x | {old_h:.2f} | {new_h:.2f} | "
              f"{old_h / new_h:.2f}x | {diff:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
