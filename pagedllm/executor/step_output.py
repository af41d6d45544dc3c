"""StepOutput: what one step produced. Token ids are on the device at once and on the host when asked for, so the
engine can queue the next step before this one's tokens are read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepEvents:
    """CUDA events around the step's device work (only when the engine asks for them, e.g. for a trace)."""

    start: torch.cuda.Event
    forward_done: torch.cuda.Event
    end: torch.cuda.Event

    @classmethod
    def create(cls) -> StepEvents:
        return cls(*(torch.cuda.Event(enable_timing=True) for _ in range(3)))

    def forward_ms(self) -> float:
        return self.start.elapsed_time(self.forward_done)

    def sampling_ms(self) -> float:
        return self.forward_done.elapsed_time(self.end)


class StepOutput:
    """sampled_token_ids[r] is the token sampled for the plan's sample row r."""

    def __init__(self, step_id: int, sampled_token_ids: torch.Tensor | None, events: StepEvents | None = None):
        self.step_id = step_id
        self.sampled_token_ids = sampled_token_ids
        self.events = events
        self.host_token_ids: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None
        # Raises if the tokens cannot be trusted (a tensor-parallel rank failed while the step ran).
        self.check_ranks: Callable[[], None] | None = None
        if sampled_token_ids is not None and sampled_token_ids.is_cuda:
            self.host_token_ids = torch.empty(sampled_token_ids.shape, dtype=sampled_token_ids.dtype, pin_memory=True)
            self.host_token_ids.copy_(sampled_token_ids, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def token_ids(self) -> list[int]:
        """Waits for the device when the step is still running."""
        if self.sampled_token_ids is None:
            return []
        if self.copied is None:
            token_ids = self.sampled_token_ids.tolist()
        else:
            self.copied.synchronize()
            token_ids = self.host_token_ids.tolist()
        if self.check_ranks is not None:
            self.check_ranks()
        return token_ids
