"""The CPU product of activations by weights kept in groups of 32 small integers (cpu_grouped_gemm.cpp), compiled
on first use with torch's C++ extension builder into torch's extension cache (~15 s once; then loaded in ms).

With AVX2 it reads the weights at near the memory's rate for one row (benchmarks/NOTES.md, "A grouped-integer CPU
kernel"); elsewhere the same C++ compiles without intrinsics. Where no compiler works, `unavailable_reason` says why
and the GGUF blocks are dequantized instead.
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

from pagedllm.logger import logger

SOURCE = Path(__file__).with_suffix(".cpp")
GROUP = 32  # values per scale and offset


def compiler_flags() -> list[str]:
    """-O3 and OpenMP (torch's threads); AVX2 + FMA where this CPU runs torch's AVX2 kernels."""
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no contraction: the code's own order of float operations
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is loaded (built first if the cache lacks it), else why it cannot be."""
    from torch.utils import cpp_extension

    flags = compiler_flags()
    isa = "avx2" if "-mavx2" in flags else "plain"
    name = re.sub(r"\W", "_", f"pagedllm_cpu_grouped_gemm_{isa}_torch_{torch.__version__}")  # a build per torch
    logger.info("Loading the CPU grouped-integer kernel (%s; compiled once, ~15 s, on the first use)", name)
    try:
        cpp_extension.load(
            name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False
        )
    except Exception as error:  # no compiler, no headers, a failed build: the caller dequantizes
        return f"the CPU grouped-integer kernel could not be built ({type(error).__name__}: {error})".splitlines()[0]
    return None


def require() -> None:
    """Load the kernel, or raise RuntimeError saying why it cannot be (kernel_selection asks first, so an engine
    never gets here without it)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)


def grouped_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """x float32 [M, K] times the weight [N, K] of `values` (bytes [N, K * bits / 8]) and `scales` (float32
    [N, 2, K / GROUP]: scales, then offsets) transposed: float32 [M, N]. Call require() once first."""
    kernel = torch.ops.pagedllm_cpu.grouped_int4_mm if bits == 4 else torch.ops.pagedllm_cpu.grouped_int8_mm
    return kernel(x, values, scales)
