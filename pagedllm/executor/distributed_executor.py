"""DistributedExecutor: rank 0's side of tensor parallelism, an Executor (executor/executor.py) as a Worker is, so
the engine drives it exactly like a Worker; rank 0's own Worker is its `worker`. Each plan goes to the other ranks
first, then rank 0 runs its own shard; the ranks' collectives meet inside the forward, and rank 0 samples.

Lifecycle: shutdown(), garbage collection and interpreter exit end every rank. A rank that fails ends the group: the
step raises a RuntimeError naming the rank and its error, and every later step raises too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import ResolvedConfig
from pagedllm.executor.executor import Executor
from pagedllm.executor.kv_cache import CompanionMemory
from pagedllm.executor.plan_broadcast import PlanSender
from pagedllm.executor.ranks import (
    STOP_TIMEOUT_S,
    SpawnedRanks,
    check_tensor_parallel,
    gather_weight_bytes,
    join_group,
    launched_by_torchrun,
    rank_device,
    serve_plans,
    share_resolved_config,
)
from pagedllm.executor.start_up import start_worker
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan
from pagedllm.executor.worker import Worker
from pagedllm.loader.checkpoint import Checkpoint
from pagedllm.logger import logger
from pagedllm.models.spec import DecoderSpec


def make_executor(
    resolved: ResolvedConfig, spec: DecoderSpec, checkpoint: Checkpoint, companion: CompanionMemory | None = None
) -> Executor:
    """A Worker for one rank; for several, checks that they can work before any process starts. companion: what a
    draft model will take beside the cache (one rank only: SpeculativeConfig.check_engine)."""
    if resolved.config.tensor_parallel_size == 1:
        return start_worker(resolved, checkpoint, companion=companion)
    check_tensor_parallel(resolved.config, spec, resolved.device)
    return DistributedExecutor(resolved, checkpoint)


@dataclass(slots=True)
class GroupState:
    ended: bool = False
    failed: bool = False  # the ranks are out of step: no shutdown can be sent, they are stopped instead
    threads_before: int | None = None  # this process's torch threads before CPU ranks shared them out


class DistributedExecutor:
    def __init__(self, resolved: ResolvedConfig, checkpoint: Checkpoint):
        """Start the other ranks (or join them, under torchrun) and load rank 0's shard.

        Under torchrun, in the processes of ranks other than 0 this serves rank 0 and then exits the process
        (SystemExit(0)): code after LLM(...) runs on rank 0 only.
        """
        size = resolved.config.tensor_parallel_size
        self.state = GroupState()
        self.ranks: SpawnedRanks | None = None
        if launched_by_torchrun():
            rank = envs.RANK.get()
            device = rank_device(resolved.device, envs.LOCAL_RANK.get())
            self.tp = join_group(rank, size, device, store=None)
            resolved = share_resolved_config(resolved, self.tp)
            if rank != 0:
                serve_plans(start_worker(resolved, checkpoint, self.tp, device))
                raise SystemExit(0)
        else:
            device = resolved.device
            if device.type == "cpu":  # CPU ranks share this host's cores: each gets 1/size of this process's threads
                self.state.threads_before = torch.get_num_threads()
                torch.set_num_threads(max(1, self.state.threads_before // size))
            device = rank_device(device, 0)
            try:
                self.ranks = SpawnedRanks(resolved, device, torch.get_num_threads())
                self.ranks.wait_until_joining()
                self.tp = join_group(0, size, device, self.ranks.store)
            except BaseException as error:
                self.fail(error)
        try:
            self.worker = start_worker(resolved, checkpoint, self.tp, device)
            self.weight_bytes_per_rank = gather_weight_bytes(self.worker)
        except BaseException as error:
            self.fail(error)
        self.device, self.num_kv_blocks = self.worker.device, self.worker.num_kv_blocks
        self.sender = PlanSender(self.tp.host_group)
        self.finalizer = weakref.finalize(self, end_group, self.worker, self.sender, self.ranks, self.state)
        logger.info(
            "tensor parallelism: %d ranks on %s; weights per rank: %s MiB", size, device.type,
            ", ".join(f"{count / 2**20:.1f}" for count in self.weight_bytes_per_rank),
        )  # fmt: skip

    def set_device_timings(self, on: bool) -> None:
        self.worker.set_device_timings(on)  # rank 0's steps carry the events: the others' are not read

    def execute(
        self, plan: StepPlan, previous: StepOutput | None = None, masks: Callable[[], np.ndarray] | None = None
    ) -> StepOutput:
        if self.state.ended:
            raise RuntimeError("this LLM's tensor-parallel ranks have ended (shutdown() or an earlier failure)")
        self.raise_if_rank_died()
        try:
            self.sender.send(plan)
            output = self.worker.execute(plan, previous, masks)  # rank 0 samples: the masks are its alone
        except BaseException as error:
            self.fail(error)
        output.check_ranks = self.raise_if_rank_died
        return output

    def raise_if_rank_died(self) -> None:
        if self.ranks is not None and self.ranks.died.is_set():
            self.fail(RuntimeError("a tensor-parallel rank ended unasked"))

    def fail(self, error: BaseException) -> NoReturn:
        """End the group after an error on rank 0 or another rank, and raise what went wrong where."""
        failure = self.ranks.failure(wait_s=2.0) if self.ranks is not None else None
        self.state.failed = True
        end_group(getattr(self, "worker", None), getattr(self, "sender", None), self.ranks, self.state)
        if failure is None or isinstance(error, KeyboardInterrupt):
            raise error
        raise RuntimeError(failure) from error

    def shutdown(self) -> None:
        """End every rank and free rank 0's memory; idempotent."""
        if hasattr(self, "finalizer"):
            self.finalizer()


def end_group(worker: Worker | None, sender: PlanSender | None, ranks: SpawnedRanks | None, state: GroupState) -> None:
    if state.ended:
        return
    state.ended = True
    if ranks is not None:
        ranks.stopping = True  # from now on a rank that exits was asked to
    if not state.failed and sender is not None:
        try:
            sender.send_shutdown()
        except RuntimeError:  # a rank is gone: the others are stopped below
            state.failed = True
    if worker is not None:
        worker.shutdown()  # CUDA graphs go before the communicators they captured
    if ranks is not None:
        ranks.stop(0.0 if state.failed else STOP_TIMEOUT_S)
    if dist.is_initialized():
        dist.destroy_process_group()
    if state.threads_before is not None:
        torch.set_num_threads(state.threads_before)
