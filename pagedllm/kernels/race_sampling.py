"""The exponential race (sampling/sampler.py) in one read of the logits: the Exp(1) noise is made in registers by
Philox and never stored. Each row takes argmax(logits / T - log E), E ~ Exp(1) per token, which samples
softmax(logits / T); a row with T == 0 takes the plain argmax. Ties go to the lowest column, as torch.argmax.

Two stages: program (row, chunk) finds its BLOCK_SIZE columns' best (score, column); torch picks each row's best
chunk of the small [rows, num_chunks] result. The seed is read from a device tensor, so a call needs no host sync
and no recompilation per seed; the number of rows is not a kernel argument, so any batch runs one specialisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# 256 rows x vocab 151,936 make 256 x 38 programs: ~74 per SM of an H200 (132 SMs). Untuned.
BLOCK_SIZE = 4096
NUM_WARPS = 4
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """FAST: the GPU's one-instruction approximation (absolute error ~2^-22); the Triton interpreter has no
    libdevice."""
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _exponential_in_log2_units(random_bits, FAST_LOG2: tl.constexpr):
    """E / ln 2 = -log2(u) of an Exp(1) draw E made from 32 random bits; never 0. u = (k + 0.5) / 2^23 of the top
    23 bits lies in [2^-24, 1 - 2^-24], and v = 1 - u is exact. Near u = 1, where the small E of likely winners come
    from, -ln(1 - v) = v + v^2/2 + v^3/3 + v^4/4 is exact to float32 (v < 2^-6: the next term is below 2^-26 of the
    sum), where a fast log2 of u would be off by up to ~10% at v ~ 2^-20; elsewhere the fast log2 is ample."""
    uniform = ((random_bits >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
    v = 1.0 - uniform
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0 + v * 0.25))) * LOG2_E
    return tl.where(v < 1.0 / 64, series, -_log2(uniform, FAST_LOG2))


@triton.jit
def _quarter_best(row_logits_ptr, first_col, lanes, vocab_size, greedy, scale, random_bits, FAST_LOG2: tl.constexpr):
    """(score, column) of the best of columns first_col + lanes: the race's score, or the logit itself when the row
    is greedy. Columns past the vocabulary score -inf, and a tie of -inf goes to the lowest column, which is in the
    vocabulary (every program starts inside it)."""
    cols = first_col + lanes
    logits = tl.load(row_logits_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    exponential = _exponential_in_log2_units(random_bits, FAST_LOG2)
    scores = tl.where(greedy, logits, logits * scale - _log2(exponential, FAST_LOG2))
    best_score, best_lane = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return best_score, first_col + best_lane


@triton.jit
def _race_chunk_kernel(
    logits_ptr,  # [rows, vocab_size] float32 or bfloat16, columns contiguous
    temperatures_ptr,  # [rows] float32; 0 = greedy (no noise)
    seed_ptr,  # [1] int64: this call's seed
    best_scores_ptr,  # [rows, num_chunks] float32: each chunk's winning score
    best_columns_ptr,  # [rows, num_chunks] int64: its column
    vocab_size,
    stride_logits_row,
    BLOCK_SIZE: tl.constexpr,  # a power of two, at least 4
    FAST_LOG2: tl.constexpr,  # True on the GPU
):
    # Program (row, chunk) covers columns [chunk * BLOCK_SIZE, (chunk + 1) * BLOCK_SIZE) as four quarters. One
    # Philox call per lane gives four 32-bit words, one for each quarter (a quarter of the work of tl.rand per
    # column), so column chunk * BLOCK_SIZE + q * QUARTER + lane draws word q of counter (row, chunk, lane): one
    # int32 counter per 4 logits, distinct while rows x vocab < 2^33 (the wrapper checks).
    QUARTER: tl.constexpr = BLOCK_SIZE // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    # Base 2 (one fast instruction per log): with E = -ln u = ln 2 * (-log2 u), the race's score logits / T - ln E
    # is ln 2 * (logits * log2(e) / T - log2(-log2 u)) minus a constant, so both have the same argmax.
    scale = LOG2_E / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr)
    row_logits_ptr = logits_ptr + row.to(tl.int64) * stride_logits_row
    lanes = tl.arange(0, QUARTER)
    random_bits = tl.randint4x(seed, (row * num_chunks + chunk) * QUARTER + lanes)
    first_col = chunk * BLOCK_SIZE
    best_score, best_col = _quarter_best(
        row_logits_ptr, first_col, lanes, vocab_size, greedy, scale, random_bits[0], FAST_LOG2
    )
    for quarter in tl.static_range(1, 4):
        quarter_col = first_col + quarter * QUARTER
        score, col = _quarter_best(
            row_logits_ptr, quarter_col, lanes, vocab_size, greedy, scale, random_bits[quarter], FAST_LOG2
        )
        # a later quarter's columns are all higher: it takes over only when strictly better (ties: lowest column)
        best_col = tl.where(score > best_score, col, best_col)
        best_score = tl.maximum(score, best_score)
    out = row * num_chunks + chunk
    tl.store(best_scores_ptr + out, best_score)
    tl.store(best_columns_ptr + out, best_col.to(tl.int64))


def race_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor | int, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """logits [rows, vocab] float32 or bfloat16, temperatures [rows] float32 (0 = greedy), seed: an int or a [1]
    int64 tensor on the logits' device (read on the device: draw it there to keep the call free of host syncs)
    -> [rows] int64 sampled columns. The same seed and shapes give the same tokens."""
    rows, vocab_size = logits.shape
    assert temperatures.shape == (rows,) and temperatures.dtype == torch.float32, "one float32 temperature per row"
    assert block_size % 4 == 0 and block_size & (block_size - 1) == 0, "block_size: a power of two, at least 4"
    if isinstance(seed, int):
        seed = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    num_chunks = triton.cdiv(vocab_size, block_size)
    assert rows * num_chunks * block_size < 2**33, "too many rows for the kernel's int32 Philox counters"
    best_scores = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_columns = torch.empty(rows, num_chunks, dtype=torch.int64, device=logits.device)
    _race_chunk_kernel[(rows, num_chunks)](
        logits, temperatures, seed, best_scores, best_columns, vocab_size, logits.stride(0),
        BLOCK_SIZE=block_size, FAST_LOG2=logits.is_cuda, num_warps=NUM_WARPS,
    )  # fmt: skip
    winning_chunk = best_scores.argmax(dim=1, keepdim=True)  # ties: the lowest chunk, whose columns come first
    return best_columns.gather(1, winning_chunk).squeeze(1)
