"""The Executor protocol: what the engine drives, a Worker on one rank, a DistributedExecutor over several, or a
stand-in that answers plans without a device (the tests' and benchmarks' fakes), handed to LLMEngine(executor=...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan


@runtime_checkable
class Executor(Protocol):
    device: torch.device  # where the steps run (a StepOutput's device tensors live there)
    num_kv_blocks: int  # blocks of the KV cache: the block manager's pool, the same on every rank

    def execute(
        self, plan: StepPlan, previous: StepOutput | None = None, masks: Callable[[], np.ndarray] | None = None
    ) -> StepOutput:
        """Queue one step without waiting for it; placeholder inputs are taken from `previous`'s samples. A plan with
        bitmask_rows comes with `masks`, which the executor calls once, after queuing the forward and before
        sampling: it returns those rows' grammar masks, [len(plan.bitmask_rows), ceil(vocab / 32)] int32 (bit t % 32
        of word t // 32 allows token t), and may first read back the step in flight (`previous`)."""
        ...

    def set_device_timings(self, on: bool) -> None:
        """While on, every StepOutput carries StepEvents around its device work (timing CUDA events on a GPU, host
        clock readings elsewhere); off, none (no per-step cost)."""
        ...

    def shutdown(self) -> None:
        """Free the device memory (and end the other ranks); no step runs after it."""
        ...
