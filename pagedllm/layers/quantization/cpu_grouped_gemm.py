"""The CPU product of activations by weights kept in groups of 32 small integers (cpu_grouped_gemm.cpp, built with
the other CPU kernels by pagedllm/cpu_kernels.py).

With AVX2 it reads the weights at near the memory's rate for one row (benchmarks/NOTES.md, "A grouped-integer CPU
kernel"); elsewhere the same C++ compiles without intrinsics.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale and offset


def grouped_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """x float32 [M, K] times the weight [N, K] of `values` (bytes [N, K * bits / 8]) and `scales` (float32
    [N, 2, K / GROUP]: scales, then offsets) transposed: float32 [M, N]. Call pagedllm.cpu_kernels.require()
    once first."""
    kernel = torch.ops.pagedllm_cpu.grouped_int4_mm if bits == 4 else torch.ops.pagedllm_cpu.grouped_int8_mm
    return kernel(x, values, scales)


def dequantize(values: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 weight [N, K] that `values` and `scales` (as grouped_mm takes them) stand for."""
    return torch.ops.pagedllm_cpu.dequantize_groups(values, scales, bits)
