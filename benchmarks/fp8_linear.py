"""FP8 linear layers on the GPU: accuracy and time of each variant against bf16 `F.linear`, in one run.

Variants: bf16 (cuBLAS); fp8 rows (per-token activations x per-row weights, `torch._scaled_mm` rowwise) with the
activations quantized by the torch expression or by the fused Triton kernel (kernels/fp8_quant.py); fp8 blocks
(1 x 128 activations x 128 x 128 weights, blockwise `torch._scaled_mm`, rows padded to a multiple of 4); and each fp8
GEMM alone on activations quantized beforehand (what the quantization costs). Every variant is timed as CUDA-graph
replays of CALLS_PER_GRAPH calls, as the engine runs it (eagerly, the quantization's launches cost the host ~100 us
and the timings measured the host).
Error: ||out - ref|| / ||ref|| against a float64 product of the unquantized activations and the weights the fp8
variant holds, dequantized (so it counts the activations' quantization and the GEMM, not the weights').

    python benchmarks/fp8_linear.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedllm.entrypoints.bench_common import median_cuda_ms
from pagedllm.kernels.fp8_quant import quantize as fused_quantize
from pagedllm.layers.quantization.fp8 import (
    BLOCK,
    dequantize_blocks,
    linear_blocks,
    linear_rows,
    quantize_blocks,
    quantize_groups,
    quantize_rows,
)

# (name, N, K): the projections of an 8B Llama and of Qwen3-0.6B
SHAPES = [
    ("llama8b qkv", 6144, 4096),
    ("llama8b o", 4096, 4096),
    ("llama8b gate_up", 28672, 4096),
    ("llama8b down", 4096, 14336),
    ("qwen3-0.6b qkv", 4096, 1024),
    ("qwen3-0.6b gate_up", 6144, 1024),
    ("qwen3-0.6b down", 1024, 3072),
]
ROWS = [1, 16, 64, 256, 1024, 4096]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm()).item()


CALLS_PER_GRAPH = 20


def median_us(function, repeats: int = 15) -> float:
    """Median over `repeats` replays of a graph of CALLS_PER_GRAPH calls, per call."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            function()  # warm-up outside the capture (cuBLAS handles, Triton compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            function()
    return median_cuda_ms(graph.replay, repeats, warmup=0) * 1e3 / CALLS_PER_GRAPH


def variants(x: torch.Tensor, weight: torch.Tensor):
    """name -> (function, dequantized weight it computes with)."""
    row_values, row_scales = quantize_rows(weight)
    block_values, block_scales = quantize_blocks(weight)
    row_weight = row_values.float() * row_scales
    block_weight = dequantize_blocks(block_values, block_scales)
    x_rows, x_row_scales = quantize_rows(x)
    x_padded = torch.cat([x, x.new_zeros(-len(x) % 4, x.shape[1])])
    x_groups, x_group_scales = quantize_groups(x_padded)
    x_group_scales = x_group_scales.t().contiguous().t()

    def fused_rows():
        values, scales = fused_quantize(x)
        return torch._scaled_mm(values, row_values.t(), scales, row_scales.t(), out_dtype=x.dtype)

    def fused_blocks():
        values, scales = fused_quantize(x_padded, BLOCK)
        return torch._scaled_mm(values, block_values.t(), scales, block_scales.t(), out_dtype=x.dtype)[: len(x)]

    return {
        "bf16": (lambda: F.linear(x, weight), weight.float()),
        "fp8 rows torch quant": (lambda: linear_rows(x, row_values, row_scales), row_weight),
        "fp8 rows fused quant": (fused_rows, row_weight),
        "fp8 rows GEMM only": (
            lambda: torch._scaled_mm(x_rows, row_values.t(), x_row_scales, row_scales.t(), out_dtype=x.dtype),
            row_weight,
        ),
        "fp8 blocks torch quant": (lambda: linear_blocks(x_padded, block_values, block_scales)[: len(x)], block_weight),
        "fp8 blocks fused quant": (fused_blocks, block_weight),
        "fp8 blocks GEMM only": (
            lambda: torch._scaled_mm(x_groups, block_values.t(), x_group_scales, block_scales.t(), out_dtype=x.dtype)[
                : len(x)
            ],
            block_weight,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two row counts, three shapes")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes, rows = (SHAPES[1:4], [16, 4096]) if args.quick else (SHAPES, ROWS)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':<20} {'M':>5} {'variant':<24} {'us':>9} {'x bf16':>7} {'rel err':>9}")
    for name, n, k in shapes:
        generator = torch.Generator(device="cuda").manual_seed(n + k)
        weight = (torch.randn(n, k, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=generator).to(torch.bfloat16)
            bf16_us = None
            for variant, (function, dequantized) in variants(x, weight).items():
                try:
                    out = function()
                    error = relative_error(out, x.double() @ dequantized.double().t())
                    us = median_us(function)
                except Exception as failure:  # a variant this torch/cuBLAS cannot run: say why, go on
                    print(f"{name:<20} {m:>5} {variant:<24} failed: {type(failure).__name__}: {failure}"[:300])
                    continue
                bf16_us = us if variant == "bf16" else bf16_us
                ratio = bf16_us / us if bf16_us else float("nan")
                print(f"{name:<20} {m:>5} {variant:<24} {us:9.1f} {ratio:7.2f} {error:9.2e}", flush=True)


if __name__ == "__main__":
    main()
