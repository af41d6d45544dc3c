"""How a linear layer holds and multiplies its weight: the seam for quantized weights. A method creates the layer's
parameters, takes a checkpoint tensor into one of them (already narrowed to this rank's shard by the layer's
weight_loader: sharding is the layer's business, the format the method's) and computes y = x W^T (+ bias).

Methods: unquantized, FP8 on GPUs (layers/quantization/fp8.py) and GGUF blocks on CPU (layers/quantization/gguf.py);
which one a layer holds is decided once, from the kernel choices (`linear_method` in layers/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu_memory import mapped_copy
from pagedllm.loader.checkpoint_tensor import CheckpointTensor, copy_weight

# How the CPU decode stack (models/cpu_decode_stack.cpp) multiplies as a method does: at::linear, oneDNN on a
# reordered weight, float32 panels (layers/cpu_float_gemm.cpp), or (4, 8) the grouped-integer kernel on values of
# that many bits.
CPU_LINEAR, CPU_ONEDNN, CPU_PANELS = 0, 1, 2
PANEL_COLUMNS = 16  # a float32 weight packs into panels when its row count is a multiple of this


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

    def cpu_product(self, layer: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
        """(kind, weight, scales): what the CPU decode stack calls to compute `apply` (kinds above), or None where
        it has no such call."""
        return None


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's linear runs on this CPU: bfloat16 needs AVX-512 (or AMX); without it oneDNN has no
    bfloat16 inner product, and such weights stay with F.linear."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


class UnquantizedLinearMethod(LinearMethod):
    """The weight as the checkpoint has it, in the model's dtype, multiplied as the kernel choices' `linear` says:
    - torch: F.linear;
    - skinny_gemm (CUDA): a product of one row of x (a one-sequence decode step), or of a few rows by a narrow
      weight, goes to those kernels, where they were measured to stream the weights faster than cuBLAS
      (kernels/skinny_gemm.py); F.linear otherwise;
    - onednn (CPU): the weight is reordered once into oneDNN's blocked layout when loaded and every product runs
      through oneDNN: 1.3-6x faster than aten::mm in float32 here, up to 2x in bfloat16 (benchmarks/NOTES.md, "GGUF
      weights on CPU");
    - cpu: a float32 weight is packed once into panels of 16 columns for the C++ kernel (layers/cpu_float_gemm.cpp:
      oneDNN's results to the bit, 1.4-1.9x faster at the 1-16 rows of decode and verify steps, as fast from 32 rows:
      NOTES, session 31); other dtypes (and a weight whose rows do not fill whole panels) as with onednn.
    The weight's layout after loading says which product it takes (`product`)."""

    def __init__(self, linear: str = "torch"):
        self.skinny_gemm = None
        self.panels = linear == "cpu"
        self.onednn_dtypes = onednn_dtypes() if linear in ("onednn", "cpu") else ()
        if linear == "skinny_gemm":
            from pagedllm.kernels import skinny_gemm as kernel  # imports Triton: only where the choices take it

            self.skinny_gemm = kernel

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        copy_weight(param, loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.product(x, layer.weight, bias)

    def finish_loading(self, layer: nn.Module) -> None:
        prepared = self.prepared(layer.weight.data)
        if prepared is not None:
            layer.weight = nn.Parameter(prepared, requires_grad=False)

    def prepared(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A copy of the plain weight [out, in] in the layout this method's product runs fastest on (float32 panels
        [out / 16, in, 16], or oneDNN's blocked layout), or None where it takes the plain weight."""
        if self.panels and weight.dtype == torch.float32 and weight.shape[0] % PANEL_COLUMNS == 0:
            # in 2 MiB pages: every step streams every panel (cpu_memory)
            return mapped_copy(torch.ops.pagedllm_cpu.pack_float_panels(weight))
        if weight.dtype in self.onednn_dtypes:
            return torch.ops.mkldnn._reorder_linear_weight(weight)
        return None

    def cpu_product(self, layer: nn.Module) -> tuple[int, torch.Tensor, None] | None:
        if self.skinny_gemm is not None:
            return None
        if layer.weight.dim() == 3:
            return CPU_PANELS, layer.weight, None
        return (CPU_ONEDNN if layer.weight.dtype in self.onednn_dtypes else CPU_LINEAR), layer.weight, None

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() == 3:  # float32 panels (prepared)
            return torch.ops.pagedllm_cpu.float_panels_mm(x, weight, bias)
        if self.skinny_gemm is not None and self.skinny_gemm.takes(x, weight):
            return self.skinny_gemm.linear(x, weight, bias)
        if weight.dtype in self.onednn_dtypes and x.dtype == weight.dtype:  # reordered, or for this call
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
