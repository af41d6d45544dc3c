"""Vectorised sampling: greedy, temperature, top-k and top-p for a whole batch in a few tensor ops.

A row samples by the exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Without top-k/top-p this
is argmax(logits / T - log E), since softmax's normaliser is shared by the whole row: no softmax is computed.
Rows with their own seed draw E from their own generator, so their tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.compile import fuse_on_cuda


@dataclass(slots=True)
class SamplingTensors:
    temperatures: torch.Tensor  # [batch] float32; 0 = greedy
    top_ps: torch.Tensor | None  # [batch] float32, None when every row has top_p == 1
    top_ks: torch.Tensor | None  # [batch] int64, None when no row uses top-k; 0 = off
    generators: list[torch.Generator | None]  # per row: its own generator (seeded request) or None
    default_generator: torch.Generator | None  # for rows without a seed of their own (the engine's seed)
    all_greedy: bool
    any_greedy: bool


def keep_top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Zero every probability outside the row's top-k and its top-p nucleus (the most likely token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_ks is not None:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        drop |= (top_ks[:, None] > 0) & (ranks[None] >= top_ks[:, None])
    if top_ps is not None:
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps[:, None]
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None], default_generator: torch.Generator | None
) -> torch.Tensor:
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=default_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


@fuse_on_cuda
def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (logits.float() / temperatures[:, None] - noise.log()).argmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """logits [batch, vocab] -> token ids [batch]."""
    if params.all_greedy:
        return logits.argmax(dim=-1)
    temperatures = torch.where(params.temperatures > 0, params.temperatures, 1.0)
    noise = exponential_noise(logits, params.generators, params.default_generator)
    if params.top_ks is None and params.top_ps is None:
        sampled_tokens = exponential_race(logits, temperatures, noise)
    else:
        probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
        probs = keep_top_k_top_p(probs, params.top_ks, params.top_ps)
        sampled_tokens = (probs / noise).argmax(dim=-1)
    if not params.any_greedy:
        return sampled_tokens
    return torch.where(params.temperatures > 0, sampled_tokens, logits.argmax(dim=-1))
