"""CheckpointTensor: a checkpoint tensor that is read only when asked for, and then only the part asked for, so a
tensor-parallel rank narrows each weight to its shard before anything leaves the file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

# Reads the part of the file's tensor given as one slice per dimension.
SliceReader = Callable[[tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    name: str
    read_slices: SliceReader
    dtype: torch.dtype  # what read() returns, whatever the file holds
    slices: tuple[slice, ...]  # the part of the file's tensor this one stands for

    @classmethod
    def lazy(cls, name: str, shape: tuple[int, ...], read_slices: SliceReader, dtype: torch.dtype) -> CheckpointTensor:
        return cls(name, read_slices, dtype, tuple(slice(0, size) for size in shape))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(part.stop - part.start for part in self.slices)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Like torch.Tensor.narrow, and reads nothing."""
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"checkpoint tensor {self.name!r} of shape {tuple(self.shape)} has no range [{start}, "
                f"{start + length}) in dimension {dim}"
            )
        offset = self.slices[dim].start + start
        slices = (*self.slices[:dim], slice(offset, offset + length), *self.slices[dim + 1 :])
        return replace(self, slices=slices)

    def read(self) -> torch.Tensor:
        """This part of the tensor, in `dtype`, on the CPU."""
        return self.read_slices(self.slices).to(self.dtype)


def copy_weight(param: torch.Tensor, loaded: CheckpointTensor) -> None:
    """The default weight loader: the whole tensor into a parameter of its shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded.read())
