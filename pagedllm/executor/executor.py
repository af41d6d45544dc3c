"""The Executor protocol: what the engine drives, a Worker on one rank, a DistributedExecutor over several, or a
stand-in that answers plans without a device (the tests' and benchmarks' fakes), handed to LLMEngine(executor=...).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan


@runtime_checkable
class Executor(Protocol):
    device: torch.device  # where the steps run (a StepOutput's device tensors live there)
    num_kv_blocks: int  # blocks of the KV cache: the block manager's pool, the same on every rank

    def execute(self, plan: StepPlan, previous: StepOutput | None = None) -> StepOutput:
        """Queue one step without waiting for it; placeholder inputs are taken from `previous`'s samples."""
        ...

    def set_device_timings(self, on: bool) -> None:
        """While on, every StepOutput carries StepEvents around its device work (timing CUDA events on a GPU, host
        clock readings elsewhere); off, none (no per-step cost)."""
        ...

    def shutdown(self) -> None:
        """Free the device memory (and end the other ranks); no step runs after it."""
        ...
