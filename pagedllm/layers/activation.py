"""SiLU-and-mul: the gated MLP's activation on the packed [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import cpu_layer_ops
from pagedllm.layers.compile import fused, fusible
from pagedllm.layers.kernel_choices import kernel_choices


@fusible
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        choices = kernel_choices()
        cpu = choices.layer_ops == "cpu"
        self.silu_and_mul = cpu_layer_ops.silu_and_mul if cpu else fused(silu_and_mul, choices.compile)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(gate_up)
