"""Many seeded draws on fixed logits follow the truncated, renormalised distribution of vLLM's top-k / top-p / min-p,
and not what an off-by-one or a wrong order would give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sampling.batch import SamplingBatch, build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler, sampling_probs

# Eight tokens carry the mass; the 56 others are nearly impossible but must never be drawn once truncated away.
HEAD = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]
LOGITS = np.log(np.array(HEAD + [1e-7] * 56))
VOCAB = len(LOGITS)
DRAWS = 12_000  # per case; sampling error in total variation is ~0.01, the bound 0.025, wrong variants >= 0.07
TV_BOUND = 0.025

CASES = {  # name: (temperature, top_k, top_p, min_p)
    "top_k": (1.0, 3, 1.0, 0.0),
    "top_p": (1.0, 0, 0.6, 0.0),
    "top_p_edge_token_large": (1.0, 0, 0.5, 0.0),
    "min_p_after_temperature": (0.7, 0, 1.0, 0.45),
    "top_k_then_renormalised_top_p": (1.0, 4, 0.7, 0.0),
    "all_with_temperature": (1.3, 5, 0.8, 0.3),  # min-p sets the prefix that top-p renormalises
    "all_top_k_binding": (1.3, 4, 0.75, 0.3),  # top-k sets it
    "temperature_only": (0.8, 0, 1.0, 0.0),
}


def expected(temperature, top_k, top_p, min_p, variant=None) -> np.ndarray:
    """vLLM's rules on a plain list, one after the other, each on what the previous left (renormalised).
    variant: a deliberately wrong rule, to show that the test tells it apart."""
    probs = np.exp(LOGITS / (1.0 if variant == "min_p_before_temperature" else temperature))
    probs /= probs.sum()
    kept = sorted(range(VOCAB), key=lambda token: -probs[token])
    kept = [token for token in kept if probs[token] >= min_p * probs[kept[0]]]
    if top_k:
        kept = kept[: top_k + (variant == "top_k_plus_one")]
    if variant == "min_p_before_temperature":  # back to the right temperature for the rest
        probs = np.exp(LOGITS / temperature)
        probs /= probs.sum()
    total = 1.0 if variant == "top_p_not_renormalised" else sum(probs[token] for token in kept)
    nucleus, mass = [], 0.0
    for token in kept:
        if variant == "top_p_drops_edge_token":
            if mass + probs[token] > top_p * total and nucleus:
                break
        elif mass >= top_p * total:
            break
        nucleus.append(token)
        mass += probs[token]
    distribution = np.zeros(VOCAB)
    distribution[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return distribution


def draw(cases: list[tuple], extra_rows: list[SamplingParams] = ()) -> tuple[list[np.ndarray], SamplingBatch]:
    """One sampler call: DRAWS rows per case (and the extra rows), all with the fixed logits."""
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for (t, k, p, m) in cases for _ in range(DRAWS)
    ] + list(extra_rows)
    batch = build_sampling_batch(params)
    sampler = Sampler(num_states=1, vocab_size=VOCAB, device=torch.device("cpu"), seed=0)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(params), 1)
    tokens = sampler(logits, batch).sampled_token_ids.numpy()
    frequencies = [np.bincount(tokens[i * DRAWS : (i + 1) * DRAWS], minlength=VOCAB) / DRAWS for i in range(len(cases))]
    return frequencies, batch


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


WRONG_VARIANTS = {
    "top_k": ["top_k_plus_one"],
    "top_p": ["top_p_drops_edge_token"],
    "top_p_edge_token_large": ["top_p_drops_edge_token"],
    "min_p_after_temperature": ["min_p_before_temperature"],
    "top_k_then_renormalised_top_p": ["top_p_not_renormalised"],
    "all_with_temperature": ["top_p_drops_edge_token", "min_p_before_temperature", "top_p_not_renormalised"],
    "all_top_k_binding": ["top_p_drops_edge_token", "top_k_plus_one", "top_p_not_renormalised"],
    "temperature_only": [],
}


@pytest.fixture(scope="module")
def frequencies() -> dict[str, np.ndarray]:
    """Every case in one mixed batch (per-row parameters): the sort path, since some rows have no top-k."""
    frequencies, batch = draw(list(CASES.values()))
    assert batch.top_k_candidates == 0
    return dict(zip(CASES, frequencies))


@pytest.mark.parametrize("case", CASES)
def test_draws_match_the_truncated_distribution(frequencies, case):
    target = expected(*CASES[case])
    assert total_variation(frequencies[case], target) < TV_BOUND, (frequencies[case][:8], target[:8])
    for variant in WRONG_VARIANTS[case]:
        wrong = expected(*CASES[case], variant=variant)
        assert total_variation(wrong, target) > 3 * TV_BOUND, f"{case}: the variant {variant} is not told apart"
        assert total_variation(frequencies[case], wrong) > TV_BOUND


def test_top_k_batches_take_the_topk_path_with_the_same_distribution():
    """Every row with a small top-k: candidates come from topk(), not a full sort; same rules, same distribution."""
    cases = [CASES["top_k"], CASES["top_k_then_renormalised_top_p"], CASES["all_with_temperature"]]
    cases.append(CASES["all_top_k_binding"])
    greedy_row = SamplingParams(temperature=0)  # greedy rows have no top-k and must not force the sort
    frequencies, batch = draw(cases, [greedy_row])
    assert 0 < batch.top_k_candidates <= VOCAB // 8  # the sampler's condition for the topk path
    for case, frequency in zip(cases, frequencies):
        assert total_variation(frequency, expected(*case)) < TV_BOUND


def test_sampling_probs_are_the_distribution_the_draws_follow():
    """sampling_probs (what a verify row's rejection rule and a draft model's q take) is each case's distribution, in
    one mixed batch with a row that truncates nothing and a greedy row; no wrong variant is as close."""
    cases = {**CASES, "nothing_truncated": (1.0, 0, 1.0, 0.0)}
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for (t, k, p, m) in cases.values()]
    batch = build_sampling_batch([*params, SamplingParams(temperature=0)])
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(params) + 1, 1)
    probs = sampling_probs(logits, batch.to_device(torch.device("cpu"), None, None)).double().numpy()
    for (name, case), row in zip(cases.items(), probs):
        assert np.abs(row - expected(*case)).max() < 1e-5, name
        for variant in WRONG_VARIANTS.get(name, []):
            assert total_variation(row, expected(*case, variant=variant)) > TV_BOUND, (name, variant)
