"""One-row products (a one-sequence decode step) on the GPU: cuBLAS, the skinny-GEMM kernel (tensor cores, rows padded
to 16) and the plain GEMV kernel (kernels/skinny_gemm.gemv: FMAs, no padding, no split-K) over its tile choices,
for every projection of each shape, and the LM heads of Qwen3-0.6B and Llama-3.2-1B (which call F.linear). Each
product is timed as one CUDA graph of that projection in every layer (the layers' weights together far larger than
the L2, as in a real step), by replay; floor: the weights' bytes at the measured copy rate.

Run on a GPU: python benchmarks/experiments/gemv_sweep.py [--shapes ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from pagedllm.entrypoints.bench_common import measure_ceilings, median_cuda_ms
from pagedllm.kernels.skinny_gemm import gemv, skinny_linear

# (layers, [(N, K) of qkv, o, gate_up, down])
SHAPES = {
    "qwen3-0.6b": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]),
    "tinyllama-1.1b": (22, [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]),
    "llama3.2-1b": (16, [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]),
    "llama3.1-8b": (32, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# (vocabulary, hidden size): one graph of two copies (each 250-530 MB: past the L2 alone)
LM_HEADS = {"qwen3-0.6b": (151936, 1024), "llama3.2-1b": (128256, 2048)}


def tile_choices():
    for block_n, block_k, warps, stages in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048),
                                                             (1, 2, 4, 8), (1, 3)):  # fmt: skip
        per_thread = block_n * block_k // (32 * warps)
        if 8 <= per_thread <= 64:  # at least one 16-byte piece a thread; partial sums that fit in registers
            yield dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)


def graph_us(weights, x, product, repeats: int = 20) -> float:
    """Microseconds a launch: one graph of the product over every layer's weight, replayed."""
    for weight in weights[:2]:
        product(x, weight)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight in weights:
            product(x, weight)
    return 1e3 * median_cuda_ms(graph.replay, repeats, warmup=3) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bandwidth = measure_ceilings(torch.device("cuda"))[2]
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s", flush=True)
    tiles = list(tile_choices())
    print(f"{len(tiles)} GEMV tile choices", flush=True)
    results, rejected = [], set()
    started = time.perf_counter()
    for shape in args.shapes:
        layers, projections = SHAPES[shape]
        products = [(name, n, k, layers) for name, (n, k) in zip(PROJECTIONS, projections)]
        if shape in LM_HEADS:
            products.append(("lm_head", *LM_HEADS[shape], 2))
        for name, n, k, copies in products:
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            reference = x.double() @ weights[0].double().T
            row = {"shape": shape, "projection": name, "n": n, "k": k, "floor_us": n * k * 2 / bandwidth * 1e6,
                   "cublas_us": graph_us(weights, x, F.linear), "skinny_us": graph_us(weights, x, skinny_linear),
                   "gemv": {}}  # fmt: skip
            for choice in tiles:
                key = "n{block_n} k{block_k} w{num_warps} s{num_stages}".format(**choice)
                if key in rejected:
                    continue
                try:
                    error = float((gemv(x, weights[0], **choice).double() - reference).norm() / reference.norm())
                except Exception as failure:  # a tile Triton cannot build (registers, shared memory)
                    print(f"  {key}: {type(failure).__name__}", flush=True)
                    rejected.add(key)
                    continue
                assert error < 1e-2, (shape, name, key, error)
                row["gemv"][key] = graph_us(weights, x, lambda a, w, choice=choice: gemv(a, w, **choice))
            best = sorted(row["gemv"], key=row["gemv"].get)[:3]
            row["best"] = best
            results.append(row)
            if args.json:  # after every projection: a call cut short keeps what it measured
                with open(args.json, "w") as out:
                    json.dump({"copy_rate": bandwidth, "results": results}, out, indent=1)
            print(f"{shape} {name} [{n}x{k}] floor {row['floor_us']:.2f} us, cuBLAS {row['cublas_us']:.2f}, "
                  f"skinny {row['skinny_us']:.2f}, gemv best " + ", ".join(f"{b} {row['gemv'][b]:.2f}" for b in best)
                  + f"  ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    print("\n| shape | projection | N x K | floor (us) | cuBLAS | skinny | best GEMV tile | GEMV | floor / GEMV |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results:
        best = row["best"][0]
        print(f"| {row['shape']} | {row['projection']} | {row['n']}x{row['k']} | {row['floor_us']:.2f} "
              f"| {row['cublas_us']:.2f} | {row['skinny_us']:.2f} | {best} | {row['gemv'][best]:.2f} "
              f"| {row['floor_us'] / row['gemv'][best]:.0%} |")  # fmt: skip
    for shape in args.shapes:
        rows = [row for row in results if row["shape"] == shape and row["projection"] != "lm_head"]
        layers = SHAPES[shape][0]
        total = {key: layers * sum(row[key] for row in rows) for key in ("floor_us", "cublas_us", "skinny_us")}
        gemv_total = layers * sum(row["gemv"][row["best"][0]] for row in rows)
        print(f"{shape}, a step's projections: floor {total['floor_us']:.0f} us, cuBLAS {total['cublas_us']:.0f}, "
              f"skinny {total['skinny_us']:.0f}, best GEMV {gemv_total:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
