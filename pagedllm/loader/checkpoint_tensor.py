"""CheckpointTensor: a checkpoint tensor that is read only when asked for, and then only the part asked for, so a
tensor-parallel rank narrows each weight to its shard before anything leaves the file. A tensor stored in quantized
blocks (GGUF) can also be read as its raw blocks, for a linear method that keeps them quantized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

# Reads the part of the file's tensor given as one slice per dimension.
SliceReader = Callable[[tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    """How a 2-D tensor is stored in a block format: each row is a run of blocks of `block_size` values, each block
    `block_bytes` bytes (scales and packed values, as the format lays them out)."""

    format: str  # the block format's name, as GGUF spells it: "Q4_1", "Q8_0", "Q4_K"...
    block_size: int
    block_bytes: int
    read_rows: Callable[[slice], torch.Tensor]  # rows [start, stop): uint8 [rows, blocks per row x block_bytes]


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    name: str
    read_slices: SliceReader
    dtype: torch.dtype  # what read() returns, whatever the file holds
    slices: tuple[slice, ...]  # the part of the file's tensor this one stands for
    blocks: QuantizedBlocks | None = None  # how the file stores it, when in quantized blocks

    @classmethod
    def lazy(
        cls,
        name: str,
        shape: tuple[int, ...],
        read_slices: SliceReader,
        dtype: torch.dtype,
        blocks: QuantizedBlocks | None = None,
    ) -> CheckpointTensor:
        return cls(name, read_slices, dtype, tuple(slice(0, size) for size in shape), blocks)

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

    def read_blocks(self) -> torch.Tensor | None:
        """This part of a block-quantized 2-D tensor as the file's bytes, uint8 [rows, blocks x block_bytes]; None
        when the tensor is not in blocks or the part's columns do not start and end on block boundaries."""
        if self.blocks is None or len(self.slices) != 2:
            return None
        rows, columns = self.slices
        size, width = self.blocks.block_size, self.blocks.block_bytes
        if columns.start % size or columns.stop % size:
            return None
        return self.blocks.read_rows(rows)[:, columns.start // size * width : columns.stop // size * width]


def copy_weight(param: torch.Tensor, loaded: CheckpointTensor) -> None:
    """The default weight loader: the whole tensor into a parameter of its shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded.read())
