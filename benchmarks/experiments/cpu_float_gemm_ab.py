"""The float32 panel product (layers/cpu_float_gemm.cpp) against oneDNN's inner product on a reordered weight (what
float32 weights ran through before), on the default model's shapes: the 30 layers' four projections (each layer's
weights its own, so they come from memory as in an engine step) and the vocabulary head, at M rows, the two
timed alternately in one process.
    python benchmarks/experiments/cpu_float_gemm_ab.py [--threads 2] [--rounds 5] [--rows 1 2 4 8 32 256]
Prints, first, whether the two give equal outputs (to the bit) at each shape and M, then each one's median time for
a step's products (layers, head) at each M and the paired speedup.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.cpu_kernels import require

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
HEAD_SHAPE = (49152, 576)
LAYERS = 30


def onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def panels(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.pagedllm_cpu.float_panels_mm(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 64, 256])
    args = parser.parse_args()
    require()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    plain = {
        name: [torch.randn(n, k, generator=generator) * 0.05 for _ in range(LAYERS)]
        for name, (n, k) in LAYER_SHAPES.items()
    }
    plain["head"] = [torch.randn(*HEAD_SHAPE, generator=generator) * 0.05]
    reorder, pack = torch.ops.mkldnn._reorder_linear_weight, torch.ops.pagedllm_cpu.pack_float_panels
    kinds = {
        "oneDNN": (onednn, {name: [reorder(w) for w in ws] for name, ws in plain.items()}),
        "panels": (panels, {name: [pack(w) for w in ws] for name, ws in plain.items()}),
    }
    print(f"{args.threads} threads; outputs equal to the bit (oneDNN against panels) at each M:")
    for m in args.rows:
        equal = []
        for name, weights in plain.items():
            x = torch.randn(m, weights[0].shape[1], generator=generator)
            a, b = (fn(x, packed[name][0]) for fn, packed in kinds.values())
            equal.append(f"{name} {'yes' if torch.equal(a, b) else f'no ({(a - b).abs().max().item():.1e})'}")
        print(f"  M = {m}: " + ", ".join(equal))

    def step(fn, packed, xs, names) -> float:
        start = time.perf_counter()
        for name in names:
            for weight in packed[name]:
                fn(xs[name], weight)
        return time.perf_counter() - start

    print("\n| M | layers oneDNN ms | layers panels ms | speedup | head oneDNN ms | head panels ms | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in args.rows:
        xs = {name: torch.randn(m, ws[0].shape[1], generator=generator) for name, ws in plain.items()}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for kind, (fn, packed) in kinds.items():
                times.setdefault((kind, "layers"), []).append(step(fn, packed, xs, LAYER_SHAPES))
                times.setdefault((kind, "head"), []).append(step(fn, packed, xs, ["head"]))
        median = {key: statistics.median(value) * 1e3 for key, value in times.items()}
        ratios = {
            part: statistics.median(a / b for a, b in zip(times[("oneDNN", part)], times[("panels", part)]))
            for part in ("layers", "head")
        }
        print(
            f"| {m} | {median[('oneDNN', 'layers')]:.1f} | {median[('panels', 'layers')]:.1f} | "
            f"{ratios['layers']:.2f}x | {median[('oneDNN', 'head')]:.1f} | {median[('panels', 'head')]:.1f} | "
            f"{ratios['head']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
