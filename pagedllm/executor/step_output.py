"""StepOutput: what one step produced. Token ids are on the device at once (the next step may read them there) and
on the host when asked for, with the logprobs that were asked for, so the engine can queue the next step before this
one's results are read back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.sampling.logprobs import LogprobsTensors
from pagedllm.sampling.sampler import SamplerOutput


class HostMark:
    """A host clock reading that acts like a timing torch.cuda.Event: on CPU the work is done when the call returns."""

    __slots__ = ("time",)

    def __init__(self):
        self.time = 0.0  # time.perf_counter() when recorded

    def record(self) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: HostMark) -> float:
        return (end.time - self.time) * 1e3


@dataclass(slots=True)
class StepEvents:
    """Marks around the step's device work (only when the engine asks for them, e.g. for a trace): timing CUDA
    events on a GPU, host clock readings elsewhere."""

    start: torch.cuda.Event | HostMark
    forward_done: torch.cuda.Event | HostMark
    end: torch.cuda.Event | HostMark

    @classmethod
    def create(cls, device: torch.device) -> StepEvents:
        if device.type == "cuda":
            return cls(*(torch.cuda.Event(enable_timing=True) for _ in range(3)))
        return cls(HostMark(), HostMark(), HostMark())

    def forward_ms(self) -> float:
        return self.start.elapsed_time(self.forward_done)

    def sampling_ms(self) -> float:
        return self.forward_done.elapsed_time(self.end)


class StepOutput:
    """sampled_token_ids[r] is the token sampled for the plan's sample row r. The host copies start at once
    (asynchronously on CUDA); token_ids(), logprobs() and prompt_logprobs() wait for them."""

    def __init__(
        self,
        step_id: int,
        sampled: SamplerOutput | None,
        prompt_logprobs: LogprobsTensors | None = None,
        events: StepEvents | None = None,
    ):
        self.step_id = step_id
        self.sampled_token_ids = None if sampled is None else sampled.sampled_token_ids  # on the device
        self.events = events
        on_cuda = (sampled is not None and sampled.sampled_token_ids.is_cuda) or (
            prompt_logprobs is not None and prompt_logprobs.token_logprobs.is_cuda
        )
        self.host_sampled = None if sampled is None else sampled.to_host(pin_memory=on_cuda)
        self.host_prompt_logprobs = None if prompt_logprobs is None else prompt_logprobs.to_host(pin_memory=on_cuda)
        self.copied: torch.cuda.Event | None = None
        # Raises if the results cannot be trusted (a tensor-parallel rank failed while the step ran).
        self.check_ranks: Callable[[], None] | None = None
        if on_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        if self.check_ranks is not None:
            self.check_ranks()

    def token_ids(self) -> list[int]:
        """Waits for the device when the step is still running."""
        if self.host_sampled is None:
            return []
        self.wait()
        return self.host_sampled.sampled_token_ids.tolist()

    def logprobs(self) -> LogprobsTensors | None:
        """On the host: one row per SamplingBatch.logprob_rows entry; None when no row asked."""
        self.wait()
        return None if self.host_sampled is None else self.host_sampled.logprobs

    def probs(self) -> torch.Tensor | None:
        """On the host: each sample row's distribution, when the plan's batch asked for it (return_probs)."""
        self.wait()
        return None if self.host_sampled is None else self.host_sampled.probs

    def prompt_logprobs(self) -> LogprobsTensors | None:
        """On the host: one row per plan.prompt_logprob_rows entry."""
        self.wait()
        return self.host_prompt_logprobs
