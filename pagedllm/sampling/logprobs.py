"""Logprobs on the device (each row's top-N tokens, and the logprob and rank of one chosen token per row: the sampled
token, or for prompt logprobs the next prompt token), and on the host as vLLM's per-position dicts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from pagedllm.sampling.batch import SamplingBatch


@dataclass(slots=True)
class LogprobsTensors:
    top_token_ids: torch.Tensor  # [rows, N] int64, most likely first
    top_logprobs: torch.Tensor  # [rows, N] float32
    token_logprobs: torch.Tensor  # [rows] float32: the chosen token's logprob
    token_ranks: torch.Tensor  # [rows] int64: 1 + how many tokens are strictly more likely than the chosen one

    def to_host(self, pin_memory: bool = False) -> LogprobsTensors:
        return LogprobsTensors(*(copy_to_host(tensor, pin_memory) for tensor in self.tensors()))

    @classmethod
    def concat(cls, parts: list[LogprobsTensors]) -> LogprobsTensors:
        """Rows of every part, in order; all parts have the same top-N."""
        return cls(*(torch.cat(tensors) for tensors in zip(*(part.tensors() for part in parts))))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.top_token_ids, self.top_logprobs, self.token_logprobs, self.token_ranks


def copy_to_host(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """With pin_memory (a CUDA device), start copying the tensor to pinned host memory: the caller syncs (an event)
    before reading it. Without, a plain copy, which a tensor already on the host does not need (it is returned)."""
    if not pin_memory:
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """logprobs [rows, vocab] (a log_softmax), token_ids [rows]: the chosen tokens. num_top may be 0."""
    top_logprobs, top_token_ids = logprobs.topk(num_top, dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    token_ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    return LogprobsTensors(top_token_ids, top_logprobs, token_logprobs.squeeze(1), token_ranks)


def position_logprobs(
    logprobs: LogprobsTensors,
    chosen_token_ids: list[int],
    num_logprobs: list[int],
    decode: Callable[[int], str] | None = None,
) -> list[PositionLogprobs]:
    """Row i: the chosen token first, then the row's top num_logprobs[i] tokens (rank 1, 2, ...).
    decode: a token id's text for Logprob.decoded_token (None leaves it None)."""
    top_ids, top_logprobs = logprobs.top_token_ids.tolist(), logprobs.top_logprobs.tolist()
    token_logprobs, token_ranks = logprobs.token_logprobs.tolist(), logprobs.token_ranks.tolist()
    text = decode or (lambda token_id: None)
    positions = []
    for row, token_id in enumerate(chosen_token_ids):
        entries = {token_id: Logprob(token_logprobs[row], token_ranks[row], text(token_id))}
        for rank, (top_id, top_logprob) in enumerate(zip(top_ids[row][: num_logprobs[row]], top_logprobs[row]), 1):
            entries.setdefault(top_id, Logprob(top_logprob, rank, text(top_id)))
        positions.append(entries)
    return positions


def sampled_position_logprobs(
    batch: SamplingBatch,
    logprobs: LogprobsTensors,
    sampled_token_ids: list[int],
    decode: Callable[[int], str] | None = None,
) -> dict[int, PositionLogprobs]:
    """Sample row -> its entries, for the rows of batch.logprob_rows (sampled_token_ids: every row's token)."""
    rows = batch.logprob_rows.tolist()
    chosen = [sampled_token_ids[row] for row in rows]
    return dict(zip(rows, position_logprobs(logprobs, chosen, batch.num_logprobs.tolist(), decode)))
