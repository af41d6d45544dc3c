"""The tensor-parallel group as the layers see it: rank, size and the collectives they need, over an explicit
torch.distributed process group (never the default group implicitly). A layer takes the group current while the
model is built (`building_with`) and keeps it, so a model built outside any group runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """Ranks 0..size-1 (the whole torch.distributed world); rank 0 schedules and samples. Every collective here is
    called by every rank in the same order (they are not matched by name)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # the model's collectives, on the device's tensors (NCCL on CUDA)
    host_group: dist.ProcessGroup | None = None  # gloo, on CPU tensors: plans and start-up agreements

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (through the host group: no device work is queued for it)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(tensor.item())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor, on every rank (the others pass a buffer of the same shape and dtype)."""
        if self.size > 1:
            dist.broadcast(tensor, src=0, group=self.group)
        return tensor

    def gather_last_dim_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's tensor concatenated along the last dimension, on rank 0; None on the other ranks."""
        if self.size == 1:
            return tensor
        shards = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor.contiguous(), shards, dst=0, group=self.group)
        return torch.cat(shards, dim=-1) if self.rank == 0 else None


SINGLE_RANK = TensorParallelGroup()
_building = SINGLE_RANK  # the group of the model being built


@contextmanager
def building_with(group: TensorParallelGroup) -> Iterator[None]:
    """Layers created inside this block shard themselves for `group` and communicate through it."""
    global _building
    previous, _building = _building, group
    try:
        yield
    finally:
        _building = previous


def tp_group() -> TensorParallelGroup:
    return _building


def tp_size() -> int:
    return _building.size


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads are split among ranks; with more ranks than KV heads, each head is replicated on size/heads ranks."""
    return max(1, num_kv_heads // size)
