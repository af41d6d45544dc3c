"""Tensor-parallel rank and size as the layers see them: torch.distributed's, or rank 0 of 1 when not initialised."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
