"""The skinny-GEMM and one-row GEMV kernels (kernels/skinny_gemm.py) under the Triton interpreter on CPU, against a
float64 reference: row counts 1..16, output features and K that are no multiple of the tiles, split K with and
without bias; the same inputs give the same bits on every call. float16 and float32 for the skinny GEMM: the
interpreter's tl.dot gets bfloat16 wrong (a 16x16 product off by 1e10), so its bfloat16 is checked on the GPU
(test_skinny_gemm_gpu.py); the GEMV has no tl.dot and is checked in bfloat16 here too.

Every call runs in one child process under the interpreter (interpreter_child.py), which prints one JSON record.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from interpreter_child import interpreter_results

from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.kernels.skinny_gemm import choose_split_k
from pagedllm.layers.linear import linear_method

# (rows, N, K, split_k, bias): None takes the kernel's own split choice
CASES = [
    (1, 96, 256, 1, False),
    (3, 40, 200, 1, True),  # N and K no multiple of the tiles (32, 128)
    (16, 64, 512, 4, False),  # every row the tensor cores take
    (5, 33, 130, 2, True),  # split K with a tail and a bias
    (8, 64, 384, None, True),  # the chooser: K = 384 is too short to split (each split keeps two steps of 128)
    (1, 64, 1024, None, False),  # the chooser: 2 tiles of N, K split in 4
    (2, 48, 1100, 3, False),  # a split count that is no power of two; the last split past K
]
DTYPES = ("float16", "float32")
# Relative error against float64. float16 measured 1.9e-4 to 2.3e-4 (its output's rounding); float32 6e-8 to 9e-8.
TOLERANCE = {"float16": 1e-3, "float32": 1e-6, "bfloat16": 1e-2}
# GEMV: (N, K, bias, tile): N and K no multiple of the tile, a tile wider than K, the default tile
GEMV_CASES = [
    (7, 300, True, dict(block_n=2, block_k=128)),
    (64, 256, False, dict(block_n=8, block_k=512)),
    (33, 1100, True, {}),
]
GEMV_DTYPES = ("bfloat16", "float16", "float32")


def case_name(case) -> str:
    rows, n, k, split_k, bias = case
    return f"{rows}x{n}x{k}-split{split_k}-{'bias' if bias else 'nobias'}"


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_the_kernel_equals_the_float64_product(results: dict, case, dtype: str) -> None:
    record = results[f"{case_name(case)}-{dtype}"]
    assert record["shape"] == [case[0], case[1]]
    assert record["finite"]
    assert record["relative_error"] < TOLERANCE[dtype], record
    assert record["same_bits_again"]


def test_the_splits_sum_to_the_unsplit_product(results: dict) -> None:
    """One product with 1, 2, 4 and 8 splits of K: float32 partial sums, so the outputs agree to 16-bit rounding."""
    outputs = results["splits"]
    for split_k, error in outputs.items():
        assert error < TOLERANCE["float16"], (split_k, error)


def gemv_case_name(case) -> str:
    n, k, bias, tile = case
    return f"gemv-{n}x{k}-{'bias' if bias else 'nobias'}-{tile.get('block_n', 'default')}"


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("case", GEMV_CASES, ids=gemv_case_name)
def test_the_gemv_equals_the_float64_product(results: dict, case, dtype: str) -> None:
    record = results[f"{gemv_case_name(case)}-{dtype}"]
    assert record["shape"] == [1, case[0]]
    assert record["finite"]
    assert record["relative_error"] < TOLERANCE[dtype], record
    assert record["same_bits_again"]


def test_one_row_goes_to_the_gemv_and_more_rows_to_the_skinny_gemm(results: dict) -> None:
    assert results["dispatch"] == {"one_row_is_gemv": True, "three_rows_are_skinny": True}


def test_no_rows_give_an_empty_output(results: dict) -> None:
    assert results["no_rows"] == [0, 64]


def test_the_split_choice_fills_the_gpu_without_thin_splits() -> None:
    # Qwen3-0.6B's projections on 132 multiprocessors, BLOCK_N 32, BLOCK_K 128
    assert choose_split_k(4096, 1024, 32, 128, 132) == 2  # qkv: 128 tiles
    assert choose_split_k(6144, 1024, 32, 128, 132) == 1  # gate_up: 192 tiles
    assert choose_split_k(1024, 2048, 32, 128, 132) == 8  # o_proj: 32 tiles
    assert choose_split_k(1024, 3072, 32, 128, 132) == 8  # down_proj
    assert choose_split_k(1024, 512, 32, 128, 132) == 2  # each split keeps two steps of BLOCK_K
    assert choose_split_k(64, 128, 32, 128, 132) == 1


def test_only_one_row_or_few_rows_and_small_weights_leave_cublas() -> None:
    """The dispatch follows the H200's measurements: one row of any 16-bit product (the GEMV); 2-4 rows of every
    Qwen3-0.6B projection, but not 16 rows; at 2-4 rows none of TinyLlama-1.1B's or Llama-3.2-1B's (hidden size
    2048), small (qkv, o) or large (gate_up, down); float32 never."""
    from pagedllm.kernels.skinny_gemm import beats_cublas, takes

    def rows(count: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.empty(count, k, device="meta", dtype=dtype)

    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        weight = torch.empty(n, k, device="meta", dtype=torch.bfloat16)
        assert beats_cublas(4, weight) and not beats_cublas(16, weight)
        assert takes(rows(1, k), weight) and takes(rows(4, k), weight) and not takes(rows(16, k), weight)
    for n, k in [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (3072, 2048), (16384, 2048), (2048, 8192)]:
        weight = torch.empty(n, k, device="meta", dtype=torch.bfloat16)
        assert not beats_cublas(2, weight), (n, k)
        assert takes(rows(1, k), weight) and not takes(rows(2, k), weight), (n, k)
        assert not takes(rows(1, k, torch.float32), weight.float()), (n, k)


def test_linear_on_cpu_is_torch_linear() -> None:
    """The kernel runs on CUDA only; the linear method the CPU's kernel choices give (oneDNN) is F.linear, up to the
    order of its sums."""
    method = linear_method(resolve_kernel_choices(None, torch.device("cpu"), head_dim=64))
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((3, 20), (7, 20), (7,)))
    torch.testing.assert_close(method.product(x, weight, bias), F.linear(x, weight, bias))
    reference = F.linear(x.bfloat16(), weight.bfloat16())
    torch.testing.assert_close(method.product(x.bfloat16(), weight.bfloat16()), reference)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).norm() / reference.norm())


def run_case(case, dtype: torch.dtype, generator: torch.Generator) -> dict:
    from pagedllm.kernels.skinny_gemm import skinny_linear

    rows, n, k, split_k, with_bias = case
    x = torch.randn(rows, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    reference = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    out = skinny_linear(x, weight, bias, split_k=split_k)
    again = skinny_linear(x, weight, bias, split_k=split_k)
    return {
        "shape": list(out.shape),
        "finite": bool(torch.isfinite(out).all()),
        "relative_error": relative_error(out, reference),
        "same_bits_again": bool(torch.equal(out, again)),
    }


def run_gemv_case(case, dtype: torch.dtype, generator: torch.Generator) -> dict:
    from pagedllm.kernels.skinny_gemm import gemv

    n, k, with_bias, tile = case
    x = torch.randn(1, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    reference = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    out = gemv(x, weight, bias, **tile)
    return {
        "shape": list(out.shape),
        "finite": bool(torch.isfinite(out).all()),
        "relative_error": relative_error(out, reference),
        "same_bits_again": bool(torch.equal(out, gemv(x, weight, bias, **tile))),
    }


def main() -> None:
    """The child process: every call under the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pagedllm.kernels.skinny_gemm import gemv, linear, skinny_linear

    generator = torch.Generator().manual_seed(1234)
    record = {}
    for case in CASES:
        for dtype in DTYPES:
            record[f"{case_name(case)}-{dtype}"] = run_case(case, getattr(torch, dtype), generator)
    x = torch.randn(4, 1024, generator=generator).half()
    weight = (torch.randn(64, 1024, generator=generator) / 32).half()
    reference = x.double() @ weight.double().T
    record["no_rows"] = list(skinny_linear(torch.empty(0, 256), torch.randn(64, 256), split_k=2).shape)
    record["splits"] = {
        str(split_k): relative_error(skinny_linear(x, weight, split_k=split_k), reference) for split_k in (1, 2, 4, 8)
    }
    for case in GEMV_CASES:
        for dtype in GEMV_DTYPES:
            record[f"{gemv_case_name(case)}-{dtype}"] = run_gemv_case(case, getattr(torch, dtype), generator)
    record["dispatch"] = {
        "one_row_is_gemv": bool(torch.equal(linear(x[:1], weight), gemv(x[:1], weight))),
        "three_rows_are_skinny": bool(torch.equal(linear(x[:3], weight), skinny_linear(x[:3], weight))),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
