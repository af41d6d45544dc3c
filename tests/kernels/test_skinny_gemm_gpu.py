"""The skinny-GEMM and GEMV kernels compiled on a CUDA GPU (run there: `pytest -m gpu tests/kernels`): the projections
of Qwen3-0.6B, TinyLlama-1.1B and Llama-3.2-1B at 1 to 16 rows (one row through both kernels), bf16 and fp16,
against float64, the same bits on every call and inside a CUDA graph. Timings: benchmarks/skinny_gemm.py,
benchmarks/experiments/gemv_sweep.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

# (N, K) of qkv, o, gate_up, down for each shape
SHAPES = {
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "tinyllama-1.1b": [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)],
    "llama3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
ROWS = (1, 3, 8, 16)
TOLERANCE = 1e-2  # relative error against float64: a 16-bit output rounds by up to 2^-8 (bf16) alone


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).norm() / reference.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_projections_equal_the_float64_product(shape: str, dtype: torch.dtype) -> None:
    from pagedllm.kernels.skinny_gemm import gemv, skinny_linear

    generator = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES[shape]:
        weight = (torch.randn(n, k, device="cuda", generator=generator) / k**0.5).to(dtype)
        bias = torch.randn(n, device="cuda", generator=generator).to(dtype)
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", generator=generator).to(dtype)
            for b, product in itertools.product((None, bias), (skinny_linear, gemv) if rows == 1 else (skinny_linear,)):
                reference = x.double() @ weight.double().T + (0 if b is None else b.double())
                out = product(x, weight, b)
                case = (n, k, rows, b is not None, product.__name__)
                assert relative_error(out, reference) < TOLERANCE, case
                assert torch.equal(out, product(x, weight, b)), case
                # no worse than cuBLAS's own product in the same dtype, by more than rounding
                cublas_error = relative_error(F.linear(x, weight, b), reference)
                assert relative_error(out, reference) < 2 * cublas_error + 1e-3, case


def test_linear_takes_the_kernel_for_few_rows_and_cublas_for_many() -> None:
    from pagedllm.kernels.skinny_gemm import DISPATCH_MAX_ROWS, takes

    weight = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    assert takes(torch.randn(DISPATCH_MAX_ROWS, 128, device="cuda", dtype=torch.bfloat16), weight)
    assert not takes(torch.randn(DISPATCH_MAX_ROWS + 1, 128, device="cuda", dtype=torch.bfloat16), weight)
    assert not takes(torch.randn(4, 128, device="cuda"), weight.float())  # float32: cuBLAS
    wide = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)  # Llama-3.2-1B's gate_up
    assert takes(torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16), wide)  # one row: the GEMV
    assert not takes(torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16), wide)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_kernels_replay_in_a_cuda_graph(rows: int) -> None:
    from pagedllm.kernels.skinny_gemm import linear

    weight = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) / 50
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    eager = linear(x, weight)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, linear(x, weight))
    assert not torch.equal(captured, eager)
