"""FP8 KV cache: K and V stored as float8 e4m3 with one power-of-two scale per (token, KV head), upcast to attend.

Scaling, chosen for accuracy and simplicity at a small byte cost (measured in benchmarks/NOTES.md):
- Per (token, KV head), dynamic: each head's row of head_dim values gets its own scale when it is stored, so no
  calibration is needed, an outlier token or head costs only its own precision, and a stored value never changes
  later (prefix caching, chunking and preemption store exactly the same bytes). A per-tensor static scale is the
  cheapest (no scale bytes) but needs calibration data we do not have; one bad scale clips or flushes a whole layer.
- A power of two: the smallest 2^k with max|row| / 2^k <= 448 (e4m3's largest value), so dividing and multiplying
  by it is exact. Quantization error is then fp8 rounding alone (relative error <= 2^-4 for every value above
  2^-13 of its row's max), and the torch reference and the Triton kernels store bit-identical bytes.
- Scales are float32 in their own tensor per layer, [num_blocks, num_kv_heads, block_size], so a kernel reads the
  scales of one head's keys of a block as one contiguous run. Cost: 4 bytes per head_dim bytes (3% at 128).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 2.0**-100  # an all-zero row still gets a normal scale (as kernels/kv_store.py's FP8_MIN_AMAX)
SCALE_DTYPE = torch.float32


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= FP8_MAX, elementwise (float32)."""
    mantissa, exponent = torch.frexp(amax.float().clamp_min(MIN_AMAX))  # amax = mantissa * 2^exponent, [0.5, 1)
    # mantissa * 2^9 <= 448 iff mantissa <= 0.875; otherwise one more factor of two.
    return torch.ldexp(torch.ones_like(mantissa), exponent - 9 + (mantissa > 0.875).int())


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (float8 e4m3 values [..., head_dim], float32 scales [...]); rows ~= values * scales."""
    scales = fp8_scales(rows.abs().amax(-1))
    return (rows.float() / scales[..., None]).to(FP8_DTYPE), scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 values [..., head_dim] times their scales [...], in dtype (exact in float32: powers of two)."""
    return (values.float() * scales[..., None]).to(dtype)
