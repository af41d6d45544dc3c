"""Activations to fp8 e4m3 in one pass per row: each program reads its row (or its group of GROUP columns) once
for the largest magnitude and once more to scale and store, so quantization costs one launch instead of the five
or six element-wise kernels of the torch expression (layers/quantization/fp8.py `quantize_rows`, the reference,
which it equals bit for bit on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)
BLOCK_SIZE = 1024


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, cols, x_stride, out_stride, scale_row_stride, scale_group_stride,
                     GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Program (row, group): columns [group * GROUP, (group + 1) * GROUP) of one row, BLOCK_SIZE at a time."""
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * GROUP
    stop = tl.minimum(start + GROUP, cols)
    offsets = tl.arange(0, BLOCK_SIZE)
    largest = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for offset in range(start, stop, BLOCK_SIZE):
        columns = offset + offsets
        values = tl.load(x_ptr + row * x_stride + columns, mask=columns < stop, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(values))
    # IEEE divisions (div_rn), as torch divides: Triton's `/` is an approximate division on the GPU (~1 ulp)
    scale = tl.maximum(tl.math.div_rn(tl.max(largest, axis=0), FP8_MAX), MIN_SCALE)
    for offset in range(start, stop, BLOCK_SIZE):
        columns = offset + offsets
        values = tl.load(x_ptr + row * x_stride + columns, mask=columns < stop, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * out_stride + columns, scaled.to(out_ptr.dtype.element_ty), mask=columns < stop)
    tl.store(scale_ptr + row * scale_row_stride + group * scale_group_stride, scale)


def quantize(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values [M, K], float32 scales): per row ([M, 1]) when group is None, else per `group` columns
    ([M, K / group], column-major, as cuBLAS's blockwise GEMM reads activation scales)."""
    rows, cols = x.shape
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    num_groups = 1 if group is None else cols // group
    # column-major [M, num_groups]: element (m, g) at g * M + m
    scales = torch.empty(num_groups, rows, dtype=torch.float32, device=x.device).t()
    block = min(BLOCK_SIZE, triton.next_power_of_2(cols if group is None else group))
    _quantize_kernel[(rows, num_groups)](
        x, values, scales, cols, x.stride(0), values.stride(0), scales.stride(0), scales.stride(1),
        GROUP=cols if group is None else group, BLOCK_SIZE=block,
    )  # fmt: skip
    return values, scales
