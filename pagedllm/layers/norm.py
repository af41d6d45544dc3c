"""RMSNorm, with the residual add fused in: norm(x + residual) also returns the new residual stream."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import cpu_layer_ops
from pagedllm.layers.casts import cast
from pagedllm.layers.compile import fused, fusible
from pagedllm.layers.kernel_choices import kernel_choices


@fusible
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does it: statistics in float32, weight applied in the input dtype.
    x32 = cast(x, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * cast(x32, x.dtype)


@fusible
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = x + residual
    x32 = cast(residual, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * cast(x32, residual.dtype), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        choices = kernel_choices()
        if choices.layer_ops == "cpu":
            self.rms_norm, self.add_rms_norm = cpu_layer_ops.rms_norm, cpu_layer_ops.add_rms_norm
        else:
            self.rms_norm = fused(rms_norm, choices.compile)
            self.add_rms_norm = fused(add_rms_norm, choices.compile)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.rms_norm(x, self.weight, self.eps)
        return self.add_rms_norm(x, residual, self.weight, self.eps)
