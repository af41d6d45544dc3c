"""The CPU layer ops (cpu_layer_ops.cpp, built by pagedllm/cpu_kernels.py) behind the signatures of the torch
expressions they replace (norm.py, activation.py), for rows of any leading shape: the C++ ops take [rows, hidden].
The model's rows are [tokens, hidden] already and pass through without a view (a view costs ~4-7 us on CPU, more
than a norm's arithmetic for one row)."""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.ops.pagedllm_cpu.rms_norm(as_rows(x), weight, eps)
    return out if x.dim() == 2 else out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    out, summed = torch.ops.pagedllm_cpu.add_rms_norm(as_rows(x), as_rows(residual), weight, eps)
    return (out, summed) if x.dim() == 2 else (out.view(x.shape), summed.view(x.shape))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = torch.ops.pagedllm_cpu.silu_and_mul(as_rows(gate_up))
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], -1)
