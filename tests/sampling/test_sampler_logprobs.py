"""Logprobs come from the raw log-softmax (before penalties, temperature, truncation), for the rows that asked only,
with the top-N in order and the sampled token's logprob and rank."""

from __future__ import annotations

import torch

from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.logprobs import compute_logprobs
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler

VOCAB = 100


def test_logprobs_of_the_rows_that_asked_equal_log_softmax():
    torch.manual_seed(0)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=10, repetition_penalty=2.0, logit_bias={3: 50.0}),
        SamplingParams(),  # asked for nothing: not gathered
        SamplingParams(logprobs=0, temperature=0),  # only the sampled token
        SamplingParams(logprobs=2, top_p=0.3, presence_penalty=1.0, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(logprobs=VOCAB, seed=4),  # the whole vocabulary, ranked
    ]
    sampler = Sampler(num_states=len(params), vocab_size=VOCAB, device=torch.device("cpu"), seed=0)
    for state_index, p in enumerate(params):
        sampler.add_request(state_index, p, prompt_token_ids=[3, 7, 9])
    batch = build_sampling_batch(params, state_indices=range(len(params)), num_output_tokens=[0] * len(params))
    for _ in range(3):  # later steps see penalties from earlier samples: logprobs stay raw
        logits = torch.randn(len(params), VOCAB) * 4
        raw = torch.log_softmax(logits, dim=-1)
        output = sampler(logits.clone(), batch)
        logprobs, sampled = output.logprobs, output.sampled_token_ids
        assert batch.logprob_rows.tolist() == [0, 2, 3, 4] and logprobs.top_token_ids.shape == (4, VOCAB)
        for index, (row, num) in enumerate(zip(batch.logprob_rows, batch.num_logprobs)):
            top_logprobs, top_ids = raw[row].topk(num)
            assert logprobs.top_token_ids[index, :num].tolist() == top_ids.tolist()
            torch.testing.assert_close(logprobs.top_logprobs[index, :num], top_logprobs)
            token = sampled[row]
            torch.testing.assert_close(logprobs.token_logprobs[index], raw[row, token])
            assert logprobs.token_ranks[index] == 1 + (raw[row] > raw[row, token]).sum()
        assert logprobs.token_ranks[1] == 1  # the greedy row took the best token
        # With logit_bias +50 on token 3 the sampled token is 3, but its logprob is still the raw one.
        assert sampled[0] == 3 and logprobs.token_logprobs[0] == raw[0, 3]


def test_compute_logprobs_ranks_and_top_entries():
    logprobs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1]]).log()
    result = compute_logprobs(logprobs, token_ids=torch.tensor([3, 1]), num_top=2)
    assert result.top_token_ids.tolist() == [[1, 2], [2, 0]] or result.top_token_ids.tolist() == [[1, 2], [2, 1]]
    assert result.token_ranks.tolist() == [3, 2]  # ties share the better rank
    torch.testing.assert_close(result.token_logprobs, torch.tensor([0.1, 0.25]).log())


def test_a_batch_without_logprobs_returns_none():
    batch = build_sampling_batch([SamplingParams(), SamplingParams(temperature=0)])
    output = Sampler(2, VOCAB, torch.device("cpu"), seed=0)(torch.randn(2, VOCAB), batch)
    assert output.logprobs is None and batch.logprob_rows is None
