"""The C++ kernels of the CPU path, built together into one library on first use with torch's C++ extension builder
(into torch's extension cache: ~15 s once, the files compiled at once; then loaded in ms):
- layers/quantization/cpu_grouped_gemm.cpp: the GGUF blocks' grouped-integer product;
- layers/cpu_float_gemm.cpp: float32 weights' product, packed into panels once;
- attention/cpu_paged_attention.cpp: decode and verify rows attended over the paged cache in place;
- layers/cpu_layer_ops.cpp: a layer's small operations (norms, SiLU-and-mul, rotation, KV store), one call each;
- models/cpu_decode_stack.cpp: a decode step's decoder layers in one call, through the kernels above;
- cpu_vector_math.h: the float arithmetic they share; cpu_kernels.h: the kernels' entry points, for C++ callers.

Where no compiler works, `unavailable_reason` says why; the GGUF blocks are then dequantized and attention runs on
the torch backend (kernel_selection decides, with one log line each).
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

from pagedllm.logger import logger

PACKAGE = Path(__file__).parent
GROUPED_GEMM_SOURCE = PACKAGE / "layers" / "quantization" / "cpu_grouped_gemm.cpp"
FLOAT_GEMM_SOURCE = PACKAGE / "layers" / "cpu_float_gemm.cpp"
PAGED_ATTENTION_SOURCE = PACKAGE / "attention" / "cpu_paged_attention.cpp"
LAYER_OPS_SOURCE = PACKAGE / "layers" / "cpu_layer_ops.cpp"
DECODE_STACK_SOURCE = PACKAGE / "models" / "cpu_decode_stack.cpp"
SOURCES = (GROUPED_GEMM_SOURCE, FLOAT_GEMM_SOURCE, PAGED_ATTENTION_SOURCE, LAYER_OPS_SOURCE, DECODE_STACK_SOURCE)


def compiler_flags() -> list[str]:
    """-O3 and OpenMP (torch's threads); AVX2 + FMA where this CPU runs torch's AVX2 kernels."""
    # no contraction: the code's own order of float operations; no trapping math: the compiler may ignore float
    # exceptions (we never read them), so it inlines floor and selects between values, and loops of them vectorize
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernels are loaded (built first if the cache lacks them), else why they cannot be."""
    from torch.utils import cpp_extension

    flags = compiler_flags()
    isa = "avx2" if "-mavx2" in flags else "plain"
    name = re.sub(r"\W", "_", f"pagedllm_cpu_kernels_{isa}_torch_{torch.__version__}")  # a build per torch
    logger.info("Loading the CPU kernels (%s; compiled once, ~15 s, on the first use)", name)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_include_paths=[str(PACKAGE)],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, no headers, a failed build: the callers fall back
        return f"the CPU kernels could not be built ({type(error).__name__}: {error})".splitlines()[0]
    return None


def require() -> None:
    """Load the kernels, or raise RuntimeError saying why they cannot be (kernel_selection asks first, so an engine
    never gets here without them)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
