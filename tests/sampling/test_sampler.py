"""The vectorised sampler: greedy rows, top-k/top-p truncation, the sampled distribution, per-request seeds."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.sampler import Sampler, SamplingTensors, is_plain_race, truncation_mask


def tensors(temperatures, top_ps=None, top_ks=None) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        divisors=torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32),
        top_ps=None if top_ps is None else torch.tensor(top_ps, dtype=torch.float32),
        top_ks=None if top_ks is None else torch.tensor(top_ks),
        generators={},
        default_generator=torch.Generator().manual_seed(0),
        all_greedy=all(t == 0 for t in temperatures),
        any_greedy=any(t == 0 for t in temperatures),
    )


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """One call of a fresh Sampler (unseeded rows draw from its generator)."""
    sampler = Sampler(num_states=len(params), vocab_size=logits.shape[-1], device=torch.device("cpu"), seed=0)
    return sampler(logits.clone(), build_sampling_batch(params)).sampled_token_ids


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    tokens = sample(logits, [SamplingParams(temperature=t) for t in [0, 1.0, 0, 0.7, 0, 1.0]])
    assert tokens[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 50)
    assert sample(logits, [SamplingParams(top_k=1)] * 8).tolist() == logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(top_p=1e-6)] * 8).tolist() == logits.argmax(-1).tolist()


def test_truncation_mask_keeps_top_k_and_the_renormalised_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    params = tensors([1.0] * 3, top_ps=[1.0, 0.72, 0.72], top_ks=[2, 0, 3])
    keep = truncation_mask(probs.log(), params)
    # Row 1: 0.4 + 0.3 < 0.72, so the third token stays. Row 2: top-p runs on the top 3 renormalised
    # (0.44, 0.33, 0.22), where 0.44 + 0.33 already reach 0.72.
    expected = [[True, True, False, False], [True, True, True, False], [True, True, False, False]]
    assert keep.tolist() == expected


def test_only_greedy_and_unseeded_untruncated_rows_are_a_plain_race():
    """The fused race kernel (PAGEDLLM_FUSED_SAMPLER=1, on CUDA) takes a batch only when no row truncates the
    distribution and none draws from its own seed; penalties, logit_bias and logprobs come before, so they may."""

    def plain(*params: SamplingParams) -> bool:
        batch = build_sampling_batch(params, range(len(params)), [0] * len(params))
        return is_plain_race(batch.to_device(torch.device("cpu"), lambda state_index: torch.Generator(), None))

    race, greedy = SamplingParams(temperature=0.6), SamplingParams(temperature=0)
    assert plain(race, greedy, SamplingParams(temperature=0, seed=3))  # a greedy row's seed draws nothing
    assert plain(race, SamplingParams(repetition_penalty=1.2, logit_bias={3: 1.0}, min_tokens=2, logprobs=2))
    for other in [{"seed": 1}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}]:
        assert not plain(race, SamplingParams(temperature=0.6, **other)), other


def test_samples_follow_the_softmax_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    tokens = sample(logits, [SamplingParams()] * 4000)
    frequencies = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(frequencies, probs, atol=0.03), frequencies


def test_a_racing_row_next_to_greedy_rows_keeps_its_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    tokens = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0.5)] * 2000)
    assert (tokens[0::2] == 0).all()
    frequencies = torch.bincount(tokens[1::2], minlength=3).float() / 2000
    assert torch.allclose(frequencies, probs**2 / (probs**2).sum(), atol=0.03), frequencies  # softmax(log p / 0.5)


def test_a_reused_batch_is_uploaded_once_and_samples_as_fresh_batches():
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(top_k=5, seed=4)]
    logits = torch.randn(3, 100)

    def draws(batches) -> list[list[int]]:
        sampler = Sampler(num_states=3, vocab_size=100, device=torch.device("cpu"), seed=0)
        sampler.add_request(2, params[2], prompt_token_ids=[0])
        return [sampler(logits.clone(), batch).sampled_token_ids.tolist() for batch in batches]

    reused = build_sampling_batch(params, state_indices=[0, 1, 2])
    assert draws([reused] * 4) == draws([build_sampling_batch(params, state_indices=[0, 1, 2]) for _ in range(4)])
    on_device = reused.on_device
    draws([reused])
    assert reused.on_device is on_device


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


def run_sampler(params: list[SamplingParams], logits: torch.Tensor, seed: int = 0, steps: int = 1) -> list[list[int]]:
    """Each row's tokens over `steps` calls on the same logits, with a fresh Sampler whose state indices are the
    rows."""
    sampler = Sampler(num_states=len(params), vocab_size=logits.shape[-1], device=torch.device("cpu"), seed=seed)
    for state_index, p in enumerate(params):
        sampler.add_request(state_index, p, prompt_token_ids=[0])
    batch = build_sampling_batch(params, state_indices=list(range(len(params))))
    return torch.stack([sampler(logits.clone(), batch).sampled_token_ids for _ in range(steps)], dim=1).tolist()


def test_top_k_one_and_tiny_temperatures_are_greedy_next_to_random_rows():
    logits = torch.randn(8, 1000)
    greedy_like = [SamplingParams(top_k=1), SamplingParams(temperature=0), SamplingParams(temperature=1e-6)]
    greedy_like.append(SamplingParams(temperature=1e-40, top_p=0.5))
    params = greedy_like + [SamplingParams(top_p=0.9), SamplingParams(min_p=0.1), SamplingParams(), SamplingParams()]
    tokens = run_sampler(params, logits, steps=3)
    for row in range(len(greedy_like)):
        assert tokens[row] == [logits[row].argmax().item()] * 3
    assert len({token for row in tokens[4:] for token in row}) > 3  # the others do sample


SEEDED = [
    SamplingParams(seed=7),
    SamplingParams(seed=8, top_k=20),
    SamplingParams(seed=9, top_p=0.8),
    SamplingParams(seed=10, min_p=0.05, temperature=0.7),
    SamplingParams(seed=11, top_k=30, top_p=0.9, min_p=0.01, temperature=1.2),
]


def test_seeded_rows_draw_the_same_alone_and_in_any_batch():
    """Alone, a seeded row takes the race or topk path; in the mixed batch the full sort: same tokens."""
    torch.manual_seed(0)
    logits = torch.randn(len(SEEDED), 500) * 2
    others = [SamplingParams(top_p=0.5), SamplingParams(temperature=0), SamplingParams(seed=3, top_k=40)]
    others += [SamplingParams(presence_penalty=0.5, min_p=0.2), SamplingParams(temperature=0.3)]
    mixed_params = others[:2] + SEEDED + others[2:]
    mixed_logits = torch.cat([torch.randn(2, 500), logits, torch.randn(3, 500)])
    in_batch = run_sampler(mixed_params, mixed_logits, seed=1, steps=6)[2 : 2 + len(SEEDED)]
    for row, params in enumerate(SEEDED):
        alone = run_sampler([params], logits[row : row + 1], seed=2, steps=6)[0]
        assert alone == in_batch[row], params
        assert len(set(alone)) > 1  # it samples
    reseeded = [SamplingParams(seed=p.seed + 100, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p) for p in SEEDED]
    assert run_sampler(reseeded, logits, steps=6) != in_batch


def test_sampler_output_copies_to_the_host():
    logits = torch.randn(3, 40)
    batch = build_sampling_batch([SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)])
    output = Sampler(3, 40, torch.device("cpu"), seed=0)(logits, batch).to_host()
    assert output.sampled_token_ids.shape == (3,) and output.logprobs.top_token_ids.shape == (2, 2)
