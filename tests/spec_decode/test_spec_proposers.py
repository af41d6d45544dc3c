"""The n-gram lookup, which drafts a verify step keeps, and back-off's rules, on plain token lists."""

from __future__ import annotations

import math

import pytest

from pagedllm.sampling.params import SamplingParams
from pagedllm.scheduler.sequence import Sequence
from pagedllm.spec_decode import backoff
from pagedllm.spec_decode.acceptance import accepted_tokens
from pagedllm.spec_decode.ngram import NgramProposer


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # the longest suffix (3 tokens) found earlier, its continuation
        ([5, 1, 2, 7, 8, 2, 6, 1, 2], 2, [7, 8]),  # suffix [1, 2] beats the later single [2]
        ([1, 2, 3, 1, 2, 4, 1, 2], 1, [4]),  # the latest occurrence
        ([1, 2, 3, 4], 2, []),  # nothing repeats
        ([7, 7, 7], 4, [7]),  # a continuation runs into the suffix, up to the end
        ([3], 2, []),
    ],
)
def test_ngram_lookup_takes_the_longest_latest_match(tokens, k, expected):
    assert NgramProposer(1, 3).propose(tokens, k) == expected


def test_ngram_lookup_needs_prompt_lookup_min_tokens():
    assert NgramProposer(2, 3).propose([1, 5, 9, 1], 3) == []  # only a 1-token suffix repeats
    assert NgramProposer(2, 3).propose([1, 5, 9, 1, 5], 3) == [9, 1, 5]


@pytest.mark.parametrize(
    ("sampled", "drafts", "kept"),
    [
        ([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7]),  # all accepted, and the last row's sample
        ([4, 9, 6, 7], [4, 5, 6], [4, 9]),  # the first sample that differs from its draft ends the run
        ([8, 5, 6, 7], [4, 5, 6], [8]),
        ([3], [], [3]),
    ],
)
def test_accepted_tokens_are_the_samples_up_to_the_first_miss(sampled, drafts, kept):
    assert accepted_tokens(sampled, drafts) == kept


def sequence(num_output_tokens: int) -> Sequence:
    seq = Sequence("0", [1, 2, 3], SamplingParams())
    seq.token_ids += [4] * num_output_tokens
    return seq


def test_low_acceptance_over_a_window_pauses_a_request_longer_each_time():
    seq = sequence(10)
    for _ in range(backoff.WINDOW - 1):
        backoff.observe(seq, 4, 0)
    assert backoff.may_speculate(seq)  # the window is not full yet
    backoff.observe(seq, 4, 0)
    assert not backoff.may_speculate(seq)
    seq.token_ids += [4] * (backoff.PAUSE_TOKENS - 1)
    assert not backoff.may_speculate(seq)
    seq.token_ids.append(4)
    assert backoff.may_speculate(seq)  # it tries again, with an empty window
    for _ in range(backoff.WINDOW):
        backoff.observe(seq, 4, 0)
    seq.token_ids += [4] * backoff.PAUSE_TOKENS
    assert not backoff.may_speculate(seq)  # the second pause is twice as long
    seq.token_ids += [4] * backoff.PAUSE_TOKENS
    assert backoff.may_speculate(seq)


@pytest.mark.parametrize("cost", [backoff.FLOAT_WEIGHTS, backoff.INT4_BLOCKS])
@pytest.mark.parametrize("num_drafts", [1, 4, 8])
def test_accepting_what_pays_for_the_verify_steps_keeps_speculating(cost, num_drafts):
    """A verify of m drafts costs cost.fixed + cost.per_draft * m decode steps: accepting one draft more than that
    each time keeps a request speculating, one fewer pauses it."""
    price = cost.fixed + cost.per_draft * num_drafts
    paying, losing = sequence(0), sequence(0)
    for _ in range(3 * backoff.WINDOW):
        backoff.observe(paying, num_drafts, min(num_drafts, math.floor(price) + 1), cost)
        backoff.observe(losing, num_drafts, math.ceil(price) - 1, cost)
    assert backoff.may_speculate(paying) and not backoff.may_speculate(losing)


def test_the_cost_follows_the_kernels_that_run():
    assert backoff.verify_cost("gguf") is backoff.INT4_BLOCKS  # KernelChoices.quantization
    assert backoff.verify_cost(None) is backoff.FLOAT_WEIGHTS
    assert backoff.verify_cost("fp8_rows") is backoff.FLOAT_WEIGHTS


def test_attempts_without_drafts_pause_too():
    seq = sequence(0)
    for _ in range(backoff.WINDOW - 1):
        backoff.observe(seq, 0, 0)
    backoff.observe(seq, 3, 3)  # a proposal between them starts the count again
    for _ in range(backoff.WINDOW - 1):
        backoff.observe(seq, 0, 0)
    assert backoff.may_speculate(seq)
    backoff.observe(seq, 0, 0)
    assert not backoff.may_speculate(seq)
