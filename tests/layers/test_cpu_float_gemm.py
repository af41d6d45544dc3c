"""The float32 panel product on CPU (layers/cpu_float_gemm.cpp): it multiplies as a float64 reference does within
float32's rounding, every row's bits are the same whatever the other rows, the tile shapes and the thread count,
the plain C++ path (CPUs without AVX2) gives the AVX2 path's bits (the one documented order of operations), and the
linear method packs exactly the weights it can."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.layers.linear_method import CPU_ONEDNN, CPU_PANELS, UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="the CPU kernels do not build")

# K: one chain block, a partial block, two blocks and a tail (the chains restart every 1024 values of k)
SHAPES = [(16, 37), (48, 576), (32, 1024), (64, 1536), (16, 2600)]


def panels_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.pagedllm_cpu.float_panels_mm(x, torch.ops.pagedllm_cpu.pack_float_panels(weight), bias)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_product_is_the_float64_products_within_float32_rounding(n, k):
    generator = torch.Generator().manual_seed(n + k)
    weight, bias = torch.randn(n, k, generator=generator), torch.randn(n, generator=generator)
    for m in (1, 2, 3, 4, 5, 7, 13, 64):
        x = torch.randn(m, k, generator=generator)
        expected = x.double() @ weight.double().t() + bias.double()
        got = panels_mm(x, weight, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # float32 sums of k products: error ~ k * eps * sum |x w|, far below a wrong term's size
        bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().t() + 1)
        assert ((got.double() - expected).abs() <= bound).all(), (m, n, k)


def test_a_rows_bits_depend_on_that_row_alone():
    """Tiles of 1, 2, 3 and 6 rows and 1-4 panels, one thread or two, blocks of rows (48 here, K > 1024) whole and
    partial: each row of every product equals that row multiplied alone, to the bit (batch composition, prompt
    chunks and speculation's verify rows change no output)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(208, 1100, generator=generator)  # 13 panels: every tile width leaves a remainder
    packed = torch.ops.pagedllm_cpu.pack_float_panels(weight)
    x = torch.randn(150, 1100, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([torch.ops.pagedllm_cpu.float_panels_mm(x[i : i + 1], packed) for i in range(150)])
        torch.set_num_threads(2)
        for m in [*range(1, 21), 47, 48, 49, 97, 150]:
            assert torch.equal(torch.ops.pagedllm_cpu.float_panels_mm(x[:m], packed), alone[:m]), m
    finally:
        torch.set_num_threads(threads)
    assert torch.ops.pagedllm_cpu.float_panels_mm(x[:0], packed).shape == (0, 208)
    strided = torch.randn(20, 2200, generator=generator)[:, ::2]  # x need not be contiguous
    assert torch.equal(torch.ops.pagedllm_cpu.float_panels_mm(strided, packed), panels_mm(strided.contiguous(), weight))


def test_wrong_operands_are_refused_with_what_is_allowed():
    with pytest.raises(RuntimeError, match="N must be a multiple of 16, got 30"):
        torch.ops.pagedllm_cpu.pack_float_panels(torch.randn(30, 8))
    packed = torch.ops.pagedllm_cpu.pack_float_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match=r"K = x's columns"):
        torch.ops.pagedllm_cpu.float_panels_mm(torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match="x: float32"):
        torch.ops.pagedllm_cpu.float_panels_mm(torch.randn(2, 8, dtype=torch.bfloat16), packed)


PLAIN_BUILD = """
import sys, torch
from torch.utils import cpp_extension
from pagedllm import cpu_kernels
cpp_extension.load(name="pagedllm_cpu_float_gemm_plain_test", sources=[str(cpu_kernels.FLOAT_GEMM_SOURCE)],
                   extra_cflags=["-O3", "-fopenmp"], extra_include_paths=[str(cpu_kernels.PACKAGE)],
                   extra_ldflags=["-fopenmp"], is_python_module=False)
x, weight, out = sys.argv[1:]
packed = torch.ops.pagedllm_cpu.pack_float_panels(torch.load(weight))
torch.save(torch.ops.pagedllm_cpu.float_panels_mm(torch.load(x), packed), out)
"""


def test_the_plain_path_gives_the_avx2_paths_bits(tmp_path):
    if "-mavx2" not in cpu_kernels.compiler_flags():
        pytest.skip("this CPU runs the plain path already (every other test here covers it)")
    generator = torch.Generator().manual_seed(1)
    x, weight = torch.randn(7, 1300, generator=generator), torch.randn(48, 1300, generator=generator)
    paths = [tmp_path / name for name in ("x.pt", "weight.pt", "out.pt")]
    torch.save(x, paths[0])
    torch.save(weight, paths[1])
    subprocess.run([sys.executable, "-c", PLAIN_BUILD, *map(str, paths)], check=True, timeout=300)
    assert torch.equal(torch.load(paths[2]), panels_mm(x, weight))  # one fma chain an output, in k's order


def test_the_method_packs_float32_weights_of_whole_panels_and_leaves_the_rest_to_onednn():
    method = UnquantizedLinearMethod("cpu")
    layer = torch.nn.Module()
    method.create_weights(layer, 24, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    plain = layer.weight.data.clone()
    method.finish_loading(layer)
    assert layer.weight.shape == (2, 24, 16) and method.cpu_product(layer)[0] == CPU_PANELS
    x = torch.randn(3, 24)
    torch.testing.assert_close(method.apply(layer, x, layer.bias), x @ plain.t() + layer.bias)
    ragged = torch.nn.Module()  # 30 rows: not whole panels, so oneDNN's layout
    method.create_weights(ragged, 24, 30, bias=False)
    ragged.weight.data.normal_()
    method.finish_loading(ragged)
    assert ragged.weight.dim() == 2
    if torch.backends.mkldnn.is_available():
        assert method.cpu_product(ragged)[0] == CPU_ONEDNN
