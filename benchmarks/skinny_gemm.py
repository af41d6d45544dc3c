"""The projections of a whole decode step at 1-16 rows: cuBLAS (F.linear), the engine's own choice between the two
(the unquantized linear method, layers/linear_method.py: "as dispatched") and the skinny-GEMM kernel's tile choices,
each as one CUDA graph over every layer's qkv, o, gate_up and down (weights of all layers: far more than the L2, as in
a real step), timed by graph replay. Floor: the weights' bytes at the measured copy bandwidth.

Run on a GPU: python benchmarks/skinny_gemm.py [--shapes qwen3-0.6b ...] [--rows 1 4 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from pagedllm.entrypoints.bench_common import measure_ceilings, median_cuda_ms
from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.kernels.skinny_gemm import skinny_linear
from pagedllm.layers.linear import linear_method

# (layers, [(N, K) of qkv, o, gate_up, down])
SHAPES = {
    "qwen3-0.6b": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]),
    "tinyllama-1.1b": (22, [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]),
    "llama3.2-1b": (16, [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]),
}
TILES = [dict(block_n=n, block_k=k) for n, k in itertools.product((16, 32, 64), (128, 256))]


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50) -> float:
    return median_cuda_ms(graph.replay, repeats, warmup=5)


def step_graph(weights, inputs, product) -> torch.cuda.CUDAGraph:
    for weight, x in zip(weights, inputs):  # compile outside the capture
        product(x, weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight, x in zip(weights, inputs):
            product(x, weight)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 4, 16])
    args = parser.parse_args()
    bandwidth = measure_ceilings(torch.device("cuda"))[2]  # as bench's roofline (a copy inside a graph: 2.8 TB/s)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows_out = []
    for shape in args.shapes:
        layers, projections = SHAPES[shape]
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(layers)
                   for n, k in projections]  # fmt: skip
        floor_us = sum(w.numel() * 2 for w in weights) / bandwidth * 1e6
        for rows in args.rows:
            inputs = [torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights]
            for x, w in zip(inputs[:4], weights[:4]):  # every tile choice is right before it is timed
                reference = x.double() @ w.double().T
                for tiles in TILES:
                    error = float((skinny_linear(x, w, **tiles).double() - reference).norm() / reference.norm())
                    assert error < 1e-2, (shape, rows, w.shape, tiles, error)
            results = {"cuBLAS": 1e3 * replay_ms(step_graph(weights, inputs, F.linear))}
            engine_product = linear_method(resolve_kernel_choices(None, torch.device("cuda"), head_dim=128)).product
            results["as dispatched"] = 1e3 * replay_ms(step_graph(weights, inputs, engine_product))  # as the engine
            results["skinny (default)"] = 1e3 * replay_ms(step_graph(weights, inputs, skinny_linear))
            for tiles in TILES:
                product = lambda x, w, tiles=tiles: skinny_linear(x, w, **tiles)  # noqa: E731
                results[f"skinny n{tiles['block_n']} k{tiles['block_k']}"] = 1e3 * replay_ms(
                    step_graph(weights, inputs, product)
                )
            best = min((name for name in results if name.startswith("skinny")), key=results.get)
            rows_out.append((shape, rows, floor_us, results, best))
            print(f"{shape} rows {rows}: " + ", ".join(f"{name} {us:.0f} us" for name, us in results.items()))
            del inputs
        del weights
        torch.cuda.empty_cache()
    print(
        "\n| shape | rows | floor (us) | cuBLAS (us) | as dispatched (us) | default (us) | best tiles | best (us) "
        "| cuBLAS / best |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, rows, floor_us, results, best in rows_out:
        print(
            f"| {shape} | {rows} | {floor_us:.0f} | {results['cuBLAS']:.0f} | {results['as dispatched']:.0f} "
            f"| {results['skinny (default)']:.0f} "
            f"| {best} | {results[best]:.0f} | {results['cuBLAS'] / results[best]:.2f} |"
        )


if __name__ == "__main__":
    main()
