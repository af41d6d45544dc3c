"""How a linear layer holds and multiplies its weight: the seam for quantized weights. A method creates the layer's
parameters, takes a checkpoint tensor into one of them (already narrowed to this rank's shard by the layer's
weight_loader: sharding is the layer's business, the format the method's) and computes y = x W^T (+ bias).

Methods: unquantized, and FP8 on GPUs (layers/quantization/fp8.py); which one a layer holds is decided once, from
the kernel choices (`linear_method` in layers/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.loader.checkpoint_tensor import CheckpointTensor, copy_weight


class LinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters: at least `weight`, and `bias` ([out_features], or None)."""
        raise NotImplementedError

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        """Copy a checkpoint tensor into `param` (a parameter of the layer, or the view of it that the shard fills)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in_features] -> x W^T + bias, [rows, out_features]."""
        raise NotImplementedError

    def finish_loading(self, layer: nn.Module) -> None:
        """Called once every tensor of the layer is loaded (a quantized method converts the weight here)."""


class UnquantizedLinearMethod(LinearMethod):
    """The weight as the checkpoint has it, in the model's dtype. y = F.linear, or, where the choices allow the
    skinny GEMM, a product of a few rows of x (a small decode step) by a narrow weight goes to that kernel, where it
    was measured to stream the weights faster than cuBLAS (kernels/skinny_gemm.py)."""

    def __init__(self, skinny_gemm: bool = False):
        self.skinny_gemm = None
        if skinny_gemm:
            from pagedllm.kernels import skinny_gemm as kernel  # imports Triton: only where the choices take it

            self.skinny_gemm = kernel

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        copy_weight(param, loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.product(x, layer.weight, bias)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.skinny_gemm is not None and self.skinny_gemm.takes(x, weight):
            return self.skinny_gemm.skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)
