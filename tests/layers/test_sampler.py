"""The vectorised sampler: greedy rows, top-k/top-p truncation, the sampled distribution, per-request seeds."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.sampler import SamplingTensors, sample, truncation_mask


def tensors(temperatures, top_ps=None, top_ks=None, generators=None, seed=0) -> SamplingTensors:
    rows = len(temperatures)
    return SamplingTensors(
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        top_ps=None if top_ps is None else torch.tensor(top_ps, dtype=torch.float32),
        top_ks=None if top_ks is None else torch.tensor(top_ks),
        generators=generators or [None] * rows,
        default_generator=torch.Generator().manual_seed(seed),
        all_greedy=all(t == 0 for t in temperatures),
        any_greedy=any(t == 0 for t in temperatures),
    )


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    tokens = sample(logits, tensors([0, 1.0, 0, 0.7, 0, 1.0]))
    assert tokens[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 50)
    assert sample(logits, tensors([1.0] * 8, top_ks=[1] * 8)).tolist() == logits.argmax(-1).tolist()
    assert sample(logits, tensors([1.0] * 8, top_ps=[1e-6] * 8)).tolist() == logits.argmax(-1).tolist()


def test_truncation_mask_keeps_top_k_and_the_renormalised_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    params = tensors([1.0] * 3, top_ps=[1.0, 0.72, 0.72], top_ks=[2, 0, 3])
    keep = truncation_mask(probs.log(), params)
    # Row 1: 0.4 + 0.3 < 0.72, so the third token stays. Row 2: top-p runs on the top 3 renormalised
    # (0.44, 0.33, 0.22), where 0.44 + 0.33 already reach 0.72.
    expected = [[True, True, False, False], [True, True, True, False], [True, True, False, False]]
    assert keep.tolist() == expected


def test_samples_follow_the_softmax_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    tokens = sample(logits, tensors([1.0] * 4000))
    frequencies = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(frequencies, probs, atol=0.03), frequencies


def test_seeded_request_is_reproducible_whatever_the_batch(llama_dir):
    llm = LLM(llama_dir)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = [prompt, {"prompt_token_ids": [9, 8]}, {"prompt_token_ids": [7] * 20}]
    in_batch = llm.generate(batch, [seeded, other, other], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == in_batch
    different_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
