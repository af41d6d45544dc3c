"""What the kernel launchers read about the device, asked of the driver once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessor_count(device: torch.device, interpreter_count: int) -> int:
    """The GPU's multiprocessors; on CPU (the Triton interpreter) interpreter_count, the caller's stand-in."""
    if device.type != "cuda":
        return interpreter_count
    return torch.cuda.get_device_properties(device).multi_processor_count
