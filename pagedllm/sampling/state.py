"""Per-request sampling state that lives on the sampling device, keyed by the request's state index
(0..max_num_seqs-1): token counts for the penalties, and the generators of seeded requests."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.compile import fused, fusible
from pagedllm.layers.kernel_choices import TORCH_KERNELS, KernelChoices
from pagedllm.sampling.batch import PenaltyTensors, array_to_device


class PenaltyState:
    """Each state index's output-token counts and prompt-token mask, as [num_states, vocab] tensors allocated with the
    first request that uses a penalty. Counts are updated on the device from the sampled ids: no host sync, so steps can
    be queued ahead of their results."""

    def __init__(self, num_states: int, vocab_size: int, device: torch.device, kernels: KernelChoices = TORCH_KERNELS):
        self.num_states, self.vocab_size, self.device, self.kernels = num_states, vocab_size, device, kernels
        self.output_counts: torch.Tensor | None = None  # [num_states, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [num_states, vocab] bool
        self.active_state_indices: set[int] = set()

    def allocate(self) -> None:
        """Allocate the counts (num_states x vocab x 5 bytes). The worker calls it on CUDA before sizing the KV cache,
        so that a penalised request can never run out of memory later; elsewhere the first penalised request does."""
        if self.output_counts is None:
            shape = (self.num_states, self.vocab_size)
            with torch.inference_mode(False):  # normal tensors: updated in place inside inference mode and out
                self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def add_request(self, state_index: int, prompt_token_ids: list[int]) -> None:
        assert 0 <= state_index < self.num_states and state_index not in self.active_state_indices, (
            f"state index {state_index} is taken or out of range"
        )
        self.allocate()
        self.active_state_indices.add(state_index)
        self.output_counts[state_index].zero_()  # queued after any update still in flight for the index's last owner
        self.prompt_mask[state_index].zero_()
        prompt = array_to_device(np.array(prompt_token_ids, dtype=np.int64), self.device, self.kernels.pin_memory)
        self.prompt_mask[state_index].index_fill_(0, prompt, True)

    def release(self, state_index: int) -> None:
        self.active_state_indices.discard(state_index)

    def apply(self, logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
        """Penalise the rows of logits [rows, vocab] float32 (in place where they are a subset) and return them."""
        assert self.output_counts is not None, "a row has penalties but no request was added with them"
        presence, frequency, repetition = penalties.presence, penalties.frequency, penalties.repetition
        if self.kernels.compile:  # one compiled signature for every mix of penalties (Sampler.warmup compiles it)
            neutral = lambda value: torch.full(penalties.state_indices.shape, value, device=logits.device)
            presence = neutral(0.0) if presence is None else presence
            frequency = neutral(0.0) if frequency is None else frequency
            repetition = neutral(1.0) if repetition is None else repetition
        counts = self.output_counts.index_select(0, penalties.state_indices)
        if penalties.ahead_rows is not None:  # a verify row's drafts before it count as its output
            one = torch.ones((), dtype=counts.dtype, device=counts.device).expand(penalties.ahead_rows.shape)
            counts.index_put_((penalties.ahead_rows, penalties.ahead_token_ids), one, accumulate=True)
        prompt_mask = self.prompt_mask.index_select(0, penalties.state_indices) if repetition is not None else None
        rows = logits if penalties.rows is None else logits.index_select(0, penalties.rows)
        penalised = fused(penalise, self.kernels.compile)(rows, counts, prompt_mask, presence, frequency, repetition)
        if penalties.rows is None:
            return penalised
        return logits.index_copy_(0, penalties.rows, penalised)

    def uncount(self, state_indices: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Take back counted tokens: those sampled by a verify step's rejected rows, which never became output."""
        minus_one = torch.full((), -1, dtype=torch.int32, device=token_ids.device).expand(token_ids.shape)
        self.output_counts.index_put_((state_indices, token_ids), minus_one, accumulate=True)

    def update(self, penalties: PenaltyTensors, sampled_token_ids: torch.Tensor) -> None:
        """Count each penalised row's sampled token (queued on the device, nothing waits)."""
        tokens = sampled_token_ids if penalties.rows is None else sampled_token_ids.index_select(0, penalties.rows)
        one = torch.ones((), dtype=torch.int32, device=tokens.device).expand(tokens.shape)
        self.output_counts.index_put_((penalties.state_indices, tokens), one, accumulate=True)


@fusible
def penalise(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's definitions. repetition: a token seen in the prompt or the output has its logit divided by the
    penalty if positive, multiplied if not. frequency: minus penalty x count in the output. presence: minus penalty
    once if the token is in the output."""
    in_output = counts > 0
    if repetition is not None:
        scale = torch.where(prompt_mask | in_output, repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if frequency is not None:
        logits = logits - frequency[:, None] * counts
    if presence is not None:
        logits = logits - presence[:, None] * in_output
    return logits


class SeededGenerators:
    """The torch.Generator of each seeded request, by state index: its draws depend on nothing else in the batch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.by_state_index: dict[int, torch.Generator] = {}

    def add_request(self, state_index: int, seed: int) -> None:
        self.by_state_index[state_index] = torch.Generator(device=self.device).manual_seed(seed)

    def release(self, state_index: int) -> None:
        self.by_state_index.pop(state_index, None)

    def __getitem__(self, state_index: int) -> torch.Generator:
        return self.by_state_index[state_index]

    def rewind(self, state_index: int, state: torch.Tensor) -> None:
        self.by_state_index[state_index].set_state(state)
