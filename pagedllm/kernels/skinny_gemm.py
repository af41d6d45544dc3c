"""y = x W^T (+ bias) for a few rows of x (M <= 16): decode steps of small batches, where the weights are the bytes.

One row (a one-sequence decode step) goes to `gemv`: no tensor cores, no padding; each program owns two output
features and streams their rows of W in 16-byte pieces, multiplying by x in float32 (FMAs) and summing once at the end.
On the H200 (benchmarks/experiments/gemv_sweep.py, graph replays of every layer's projection) it took 1.03-3.9x less
time than cuBLAS at one row on every projection of Qwen3-0.6B, TinyLlama-1.1B, Llama-3.2-1B and Llama-3.1-8B, within
9% of the best of 132 tile choices on each (a step's projections, Qwen3-0.6B: 861 us cuBLAS, 656 skinny, 461 best).

Two to MAX_ROWS rows go to `skinny_linear`. One program owns BLOCK_N output features and a slice of K: it streams its
[BLOCK_N, K slice] of W once, in 16-byte rows along K, and multiplies the x rows (padded to 16 for the tensor cores,
masked) into a float32 accumulator. With few output features (o_proj, down_proj) K is split so that every
multiprocessor has work; each split writes float32 partial sums and a second kernel adds them in split order
(deterministic: no atomics) with the bias, in W's dtype.

Both sum in an order fixed by the shapes alone: the same inputs give the same bits on every call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.device import multiprocessor_count

MAX_ROWS = 16  # rows of x one launch takes: the tensor cores' smallest M
# The unquantized linear method (layers/linear_method.py) sends a product of 2-4 rows to skinny_linear only where
# the H200 measured it faster than cuBLAS (benchmarks/skinny_gemm.py, whole-step graphs of every layer's
# projections): Qwen3-0.6B's (hidden size 1024: each weight has a side of 1024, and at most 6.3M values) at 4 rows
# (692 vs 742 us), but not at 16 (707 vs 651). TinyLlama-1.1B's and Llama-3.2-1B's (hidden size 2048) were 2-5%
# slower, whether the kernel took every projection or only those of at most 8M values. One row always takes gemv.
DISPATCH_MAX_ROWS = 4
DISPATCH_MAX_SIDE = 1024
DISPATCH_MAX_WEIGHTS = 1 << 23


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr,  # [num_rows, K]
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [num_rows, N] when SPLIT_K == 1, else float32 partials [SPLIT_K, num_rows, N]
    num_rows,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, 16)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, feature_ok = rows < num_rows, features < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + features[:, None] * stride_w + ks[None, :], mask=feature_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)
    mask = row_ok[:, None] & feature_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + features[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        partial = out_ptr + (pid_k * num_rows + rows[:, None]) * N + features[None, :]
        tl.store(partial, acc, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _sum_splits_kernel(
    partial_ptr,  # [SPLIT_K, num_rows, N] float32
    bias_ptr,
    out_ptr,  # [num_rows, N]
    num_rows,
    N,
    stride_out,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    features = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = features < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # in split order: the same sum on every run
        total += tl.load(partial_ptr + (split * num_rows + row) * N + features, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + features, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + features, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]: one row
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [N]
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # No tensor cores: each thread multiplies its 16-byte pieces of W by x in float32 and keeps the products apart
    # until the loop ends ([BLOCK_N, BLOCK_K] partial sums), so the loop is loads and FMAs and one reduction closes it.
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + features[:, None] * stride_w + ks[None, :], mask=feature_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + features, y.to(out_ptr.dtype.element_ty), mask=feature_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 2,
    block_k: int = 1024,
    num_warps: int = 4,
    num_stages: int = 1,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row x [1, K] and weight [N, K] with contiguous rows, without tensor cores.
    The default tile is the one closest to each projection's best in the sweep (module docstring)."""
    assert x.shape[0] == 1 and weight.shape[1] == x.shape[1] and weight.stride(1) == 1 and x.stride(1) == 1
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def choose_split_k(n: int, k: int, block_n: int, block_k: int, programs_wanted: int, max_split: int = 8) -> int:
    """The fewest K splits that give programs_wanted programs, keeping at least two BLOCK_K steps per split."""
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < programs_wanted and split < max_split and k // (2 * split * 2) >= block_k:
        split *= 2
    return split


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 128,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most MAX_ROWS rows, weight [N, K] with contiguous rows."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if split_k is None:
        # On CPU the H200's count, so that the interpreter tests take the GPU's split choices
        split_k = choose_split_k(n, k, block_n, block_k, multiprocessor_count(x.device, interpreter_count=132))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    target = out if split_k == 1 else torch.empty(split_k, num_rows, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, bias if bias is not None else weight, target, num_rows, n, k, x.stride(0), weight.stride(0),
        out.stride(0), k_per_split, HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block))](
            target, bias if bias is not None else weight, out, num_rows, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block,
        )  # fmt: skip
    return out


def beats_cublas(num_rows: int, weight: torch.Tensor) -> bool:
    """Few rows and a small, narrow weight: where the kernel was measured faster than cuBLAS (DISPATCH_MAX_ROWS)."""
    return (
        num_rows <= DISPATCH_MAX_ROWS
        and min(weight.shape) <= DISPATCH_MAX_SIDE
        and weight.numel() <= DISPATCH_MAX_WEIGHTS
    )


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the linear method sends this product to `linear` (where the kernel choices allow the kernels at all:
    CUDA, PAGEDLLM_SKINNY_GEMM on): 16-bit, one row, or a few rows where skinny_linear beats cuBLAS."""
    return (
        x.dim() == 2
        and (x.shape[0] == 1 or beats_cublas(x.shape[0], weight))
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product of a call that `takes` accepted: one row through gemv, more through skinny_linear."""
    if x.shape[0] == 1:
        return gemv(x, weight, bias)
    return skinny_linear(x, weight, bias)
