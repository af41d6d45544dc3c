"""The CPU grouped-integer kernel (layers/quantization/cpu_grouped_gemm.cpp): its rows' bits do not depend on the
thread count or on empty steps; the plain C++ path (CPUs without AVX2) computes what the AVX2 path does; and where
the kernel cannot be built, GGUF blocks are dequantized with the reason in the log, or `quantization="gguf"` fails
naming it."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.kernel_selection import resolve_quantization
from pagedllm.layers.quantization.gguf import IntGroups, pack

K, N = 256, 40


def weights(bits: int) -> IntGroups:
    generator = torch.Generator().manual_seed(bits)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    values = torch.randint(low, high, (N, K), generator=generator, dtype=torch.int16)
    values = values.to(torch.uint8 if bits == 4 else torch.int8)
    scales = torch.rand(N, K // 32, generator=generator) * 0.01
    return IntGroups(values, scales, torch.randn(N, K // 32, generator=generator) * 0.01, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_do_not_depend_on_the_thread_count_and_empty_steps_work(bits):
    packed = pack(weights(bits))
    x = torch.randn(13, K)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed.multiply(x)
        torch.set_num_threads(2)
        two = packed.multiply(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert packed.multiply(x[:0]).shape == (0, N)


PLAIN_BUILD = """
import sys, torch
from torch.utils import cpp_extension
from pagedllm import cpu_kernels
cpp_extension.load(name="pagedllm_cpu_grouped_gemm_plain_test", sources=[str(cpu_kernels.GROUPED_GEMM_SOURCE)],
                   extra_cflags=["-O3", "-fopenmp"], extra_include_paths=[str(cpu_kernels.PACKAGE)],
                   extra_ldflags=["-fopenmp"], is_python_module=False)
x, values, scales, out = sys.argv[1:]
torch.save(torch.ops.pagedllm_cpu.grouped_int4_mm(torch.load(x), torch.load(values), torch.load(scales)), out)
"""


def test_the_plain_path_computes_what_the_avx2_path_does(tmp_path):
    if "-mavx2" not in cpu_kernels.compiler_flags():
        pytest.skip("this CPU runs the plain path already (every other test here covers it)")
    packed = pack(weights(4))
    x = torch.randn(6, K) * torch.logspace(-2, 2, K)
    paths = [tmp_path / name for name in ("x.pt", "values.pt", "scales.pt", "out.pt")]
    for path, tensor in zip(paths, (x, packed.values, packed.scales), strict=False):
        torch.save(tensor, path)
    subprocess.run([sys.executable, "-c", PLAIN_BUILD, *map(str, paths)], check=True, timeout=300)
    plain, avx2 = torch.load(paths[-1]), packed.multiply(x)
    assert ((plain - avx2).abs().max() / avx2.abs().max()).item() < 1e-6  # the same integers, float sums reordered


def test_a_kernel_that_cannot_be_built_dequantizes_the_blocks_and_says_why(monkeypatch, caplog):
    reason = "the CPU grouped-integer kernel could not be built (OSError: no compiler)"
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: reason)
    cpu = torch.device("cpu")
    logger = logging.getLogger("pagedllm")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert resolve_quantization("auto", cpu, checkpoint_format="gguf") is None
    assert f"GGUF blocks dequantized: {reason}" in caplog.text
    with pytest.raises(ValueError, match=r"quantization='gguf': .*OSError: no compiler.*use quantization=None"):
        resolve_quantization("gguf", cpu, checkpoint_format="gguf")
