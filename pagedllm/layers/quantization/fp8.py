"""FP8 (e4m3) weights and activations for the linear layers on GPUs with FP8 tensor cores (compute capability 8.9+).

Two ways to scale, both with activations quantized as they arrive (dynamic, no calibration):
- rows: one scale per output row of the weight, one per token of the activations (`torch._scaled_mm` rowwise);
- blocks: one scale per 128 x 128 block of the weight, one per 128 columns of each token (DeepSeek-V3's and the
  `-FP8` checkpoints' layout; `torch._scaled_mm` blockwise, SM90).
value = fp8 x scale, so dequantize(quantize(w)) is w to within e4m3's 3 mantissa bits.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear_method import UnquantizedLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128  # the block scheme's block edge, for weights (128 x 128) and activations (1 x 128)
MIN_SCALE = 1e-12  # an all-zero row or block gets this scale, not a division by zero


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales [rows, 1]): each row scaled so its largest magnitude is FP8_MAX."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales [rows, cols / group]): each `group` columns of a row scaled on their own."""
    rows, cols = x.shape
    grouped = x.float().reshape(rows, cols // group, group)
    scales = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (grouped / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(rows, cols), scales.squeeze(-1)


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales [ceil(N / block), ceil(K / block)]) of an [N, K] weight, ragged edges allowed."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, device=weight.device)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scales = (tiles.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    values = (tiles / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(padded.shape)[:rows, :cols]
    return values.contiguous(), scales.reshape(scales.shape[0], scales.shape[2])


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    expanded = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return values.float() * expanded[: values.shape[0], : values.shape[1]]


def linear_rows(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor, bias=None) -> torch.Tensor:
    """x [M, K] (16-bit) times an fp8 weight [N, K] with row scales [N, 1]: activations scaled per token."""
    values, scales = quantize_rows(x)
    out = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scales.t(), out_dtype=x.dtype)
    return out if bias is None else out + bias


def linear_blocks(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor, bias=None) -> torch.Tensor:
    """x [M, K] times an fp8 weight [N, K] with 128 x 128 block scales; activations scaled per 128 columns. The
    activation scales go in column-major, as cuBLAS's blockwise kernels read them."""
    values, scales = quantize_groups(x)
    scales = scales.t().contiguous().t()
    out = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scales.t(), out_dtype=x.dtype)
    return out if bias is None else out + bias


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, x.shape[1])])


class Fp8LinearMethod(UnquantizedLinearMethod):
    """FP8 weights, one byte a parameter. The weight loads as the unquantized method loads it (16-bit; an FP8
    checkpoint's values dequantized by the loader, loader/fp8_checkpoint.py), then `finish_loading` quantizes it:
    per row, or per 128 x 128 block (which gives back a block-quantized checkpoint's own fp8 values: the largest
    magnitude of each of its blocks was 448 x its scale). Activations are quantized as they arrive, in one Triton
    kernel, per token (rows) or per 128 columns of each token (blocks)."""

    FEATURE_MULTIPLE = 16  # torch._scaled_mm's shapes
    ROW_MULTIPLE = 4  # cuBLAS's blockwise fp8 GEMM takes no fewer than 4 rows of activations (M = 1 fails)
    # and reads the weight's block scales with a leading dimension of a multiple of 4 blocks, where torch 2.11
    # hands them over contiguous (K / 128 = 1 or 2 gave garbage on the H200): K / 128 must be a multiple of 4
    SCALE_COLUMN_MULTIPLE = 4

    def __init__(self, scaling: str):
        super().__init__()  # "torch": its own products below
        assert scaling in ("rows", "blocks"), scaling
        self.scaling = scaling

    def finish_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        out_features, in_features = weight.shape
        if out_features % self.FEATURE_MULTIPLE or in_features % self.FEATURE_MULTIPLE:
            raise ValueError(
                f"fp8 weights need in_features and out_features divisible by {self.FEATURE_MULTIPLE} on each rank, "
                f"this layer has {in_features} x {out_features}; use quantization=None"
            )
        if self.scaling == "blocks" and in_features % (BLOCK * self.SCALE_COLUMN_MULTIPLE):
            raise ValueError(
                f"fp8 block scaling needs in_features divisible by {BLOCK * self.SCALE_COLUMN_MULTIPLE} on each rank, "
                f"this layer has {in_features}; use row scaling (PAGEDLLM_FP8_SCALING=rows)"
            )
        values, scales = quantize_blocks(weight) if self.scaling == "blocks" else quantize_rows(weight)
        layer.weight = nn.Parameter(values, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagedllm.kernels.fp8_quant import quantize  # Triton: imported only where the method runs

        rows = x.shape[0]
        if self.scaling == "rows":
            values, scales = quantize(x)
        else:
            values, scales = quantize(pad_rows(x, self.ROW_MULTIPLE), BLOCK)
        out = torch._scaled_mm(values, layer.weight.t(), scales, layer.weight_scale.t(), out_dtype=x.dtype)[:rows]
        return out if bias is None else out + bias
