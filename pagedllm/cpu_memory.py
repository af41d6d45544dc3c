"""CPU tensors in memory mapped for them: zeroed pages the OS maps on first write, asked for in 2 MiB pages.

Large CPU tensors that every step reads or first writes (the KV cache, float32 weights in panels) take 1/512 the
page faults and TLB entries in 2 MiB pages (Linux's transparent huge pages, MADV_HUGEPAGE, where the kernel allows
it; elsewhere the map is plain 4 KiB pages). The map is made 2 MiB larger than the tensor, which starts at its first
2 MiB boundary, so every whole 2 MiB of the tensor can be one page; its last, partial 2 MiB stays in 4 KiB pages. A
first write maps the whole 2 MiB page around it: resident memory grows in 2 MiB steps.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros (all-zero bytes: 0.0 in every float format) in its own map; pages are mapped
    when first written, so an unwritten part costs no resident memory. The tensor, and every view of it, holds the
    map alive."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, num_bytes + HUGE_PAGE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # maps nothing yet
    start = -whole.data_ptr() % HUGE_PAGE
    huge_bytes = num_bytes // HUGE_PAGE * HUGE_PAGE  # the tensor's whole 2 MiB pages; its tail stays in 4 KiB ones
    if huge_bytes and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE, start, huge_bytes)
    return whole[start : start + num_bytes].view(dtype).view(shape)


def mapped_copy(tensor: torch.Tensor) -> torch.Tensor:
    """tensor's values in a mapped_zeros tensor (contiguous)."""
    copy = mapped_zeros(tuple(tensor.shape), tensor.dtype)
    copy.copy_(tensor)
    return copy
