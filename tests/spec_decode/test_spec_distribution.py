"""On fixed logits, 200,000 verify steps of one draft each (q one-hot, as both proposers' drafts are) keep tokens whose
frequencies match the target distribution (chi-square, a fixed seed): the first token follows the first row's
distribution whether the draft was accepted or not, the token after an accepted draft follows the second row's, and
the draft is accepted as often as the first row's distribution gives it. Rows with top-k, top-p and temperature
show that the request's settings shape the distribution the drafts are tested against."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare

from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import sample_tokens
from pagedllm.spec_decode.acceptance import accepted_tokens

DRAWS = 200_000
VOCAB = 12
ROW_LOGITS = np.array(
    [
        [2.0, 1.5, 1.2, 0.9, 0.5, 0.4, 0.1, -0.2, -0.5, -1.0, -1.5, -3.0],  # after the last token
        [0.1, -0.4, 1.8, 0.3, 1.1, -2.0, 0.6, 0.0, -0.8, 0.9, -1.2, 0.2],  # after the draft
    ]
)
DRAFT = 1  # the draft token: likely, but not the most likely
SETTINGS = {
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.3, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
}
P_VALUE = 1e-3


def target(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a request's settings make of one row's logits: temperature, then top-k, then top-p on what
    top-k left (vLLM's rules), renormalised."""
    probs = np.exp(logits / params.temperature)
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(VOCAB, dtype=bool)
    keep[order[: params.top_k if params.top_k > 0 else VOCAB]] = True
    kept = np.where(keep, probs, 0) / probs[keep].sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    keep[order[mass_before >= params.top_p]] = False
    return np.where(keep, probs, 0) / probs[keep].sum()


def observed_and_expected(counts: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cells the distribution gives mass (a token outside it must never be drawn)."""
    assert counts[probs == 0].sum() == 0, "a token the settings exclude was drawn"
    return counts[probs > 0], probs[probs > 0] * counts.sum()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_verified_tokens_follow_the_target_distribution(name):
    params = SETTINGS[name]
    logits = torch.tensor(np.tile(ROW_LOGITS, (DRAWS, 1)), dtype=torch.float32)  # the two rows of each step
    batch = build_sampling_batch([params] * len(logits))
    generator = torch.Generator().manual_seed(0)
    sampled = sample_tokens(logits, batch.to_device(torch.device("cpu"), None, generator)).sampled_token_ids
    # Each distinct pair of samples once, weighted by how often it was drawn.
    pairs, times = np.unique(sampled.view(DRAWS, 2).numpy(), axis=0, return_counts=True)
    first, after_draft, accepted = np.zeros(VOCAB, dtype=np.int64), np.zeros(VOCAB, dtype=np.int64), 0
    for pair, count in zip(pairs.tolist(), times.tolist()):
        tokens = accepted_tokens(pair, [DRAFT])
        first[tokens[0]] += count
        if len(tokens) == 2:
            after_draft[tokens[1]] += count
            accepted += count
    p_first, p_after = target(ROW_LOGITS[0], params), target(ROW_LOGITS[1], params)
    assert chisquare(*observed_and_expected(first, p_first)).pvalue > P_VALUE
    assert chisquare(*observed_and_expected(after_draft, p_after)).pvalue > P_VALUE
    assert binomtest(accepted, DRAWS, p_first[DRAFT]).pvalue > P_VALUE  # min(1, p(x) / q(x)) with q(x) = 1
