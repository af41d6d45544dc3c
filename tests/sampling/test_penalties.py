"""Penalties, logit_bias and min_tokens equal a plain per-row reference of vLLM's definitions, and the device-side
token counts equal a recount of what was sampled."""

from __future__ import annotations

import math
import random
from collections import Counter

import torch

from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler, process_logits

VOCAB = 40
EOS = frozenset({1, 2})
CPU = torch.device("cpu")


def reference(logits: list[float], prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    """vLLM, one row: logit_bias and min_tokens first; then repetition over prompt and output tokens (divide a
    positive logit, multiply a negative one), frequency per output occurrence, presence once per output token."""
    logits = list(logits)
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | (set() if params.ignore_eos else EOS):
            logits[token] = -math.inf
    counts = Counter(output)
    for token in range(VOCAB):
        if token in prompt or token in counts:
            penalty = params.repetition_penalty
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        logits[token] -= params.frequency_penalty * counts[token]
        logits[token] -= params.presence_penalty * (counts[token] > 0)
    return logits


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["penalties", "bias", "min_tokens", "all", "none"])
    fields = {}
    if kind in ("penalties", "all"):
        fields["repetition_penalty"] = rng.choice([1.0, 0.7, 1.3, 2.0])
        fields["presence_penalty"] = rng.choice([0.0, -1.0, 0.5, 2.0])
        fields["frequency_penalty"] = rng.choice([0.0, -0.5, 0.3, 2.0])
    if kind in ("bias", "all"):
        fields["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
    if kind in ("min_tokens", "all"):
        fields["min_tokens"] = rng.randint(1, 8)
        fields["stop_token_ids"] = rng.sample(range(VOCAB), rng.randint(0, 2))
        fields["ignore_eos"] = rng.random() < 0.3
    return SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=None, **fields)


def test_processed_logits_equal_the_reference():
    rng = random.Random(0)
    torch.manual_seed(0)
    num_rows = 24
    params = [random_params(rng) for _ in range(num_rows)]
    params[0] = SamplingParams(repetition_penalty=1.5)  # a token repeated in the prompt only is penalised once
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(num_rows)]
    prompts[0] = [5, 5, 5, 6]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))] for _ in range(num_rows)]
    outputs[0] = [7, 7]
    sampler = Sampler(num_states=num_rows + 3, vocab_size=VOCAB, device=CPU, seed=0)
    state_indices = [num_rows + 2 - row for row in range(num_rows)]  # state indices need not follow rows
    for row in range(num_rows):
        sampler.add_request(state_indices[row], params[row], prompts[row])
    for step in range(max(map(len, outputs))):  # feed the histories as if sampled, only rows still generating
        rows = [row for row in range(num_rows) if len(outputs[row]) > step]
        batch = build_sampling_batch([params[r] for r in rows], [state_indices[r] for r in rows], [step] * len(rows))
        tensors = batch.to_device(CPU, sampler.generators.__getitem__, None)
        if tensors.penalties is not None:
            sampler.penalties.update(tensors.penalties, torch.tensor([outputs[r][step] for r in rows]))
    logits = torch.randn(num_rows, VOCAB) * 3
    batch = build_sampling_batch(params, state_indices, [len(output) for output in outputs], EOS)
    tensors = batch.to_device(CPU, sampler.generators.__getitem__, None)
    processed = process_logits(logits.clone(), tensors, sampler.penalties)
    for row in range(num_rows):
        expected = torch.tensor(reference(logits[row].tolist(), prompts[row], outputs[row], params[row]))
        torch.testing.assert_close(processed[row], expected, msg=f"row {row}: {params[row]}")
    assert processed[0, 5] == logits[0, 5] / 1.5 if logits[0, 5] > 0 else logits[0, 5] * 1.5


def test_min_tokens_bans_eos_and_stop_tokens_only_below_min_tokens():
    params = [SamplingParams(min_tokens=3, stop_token_ids=[9]), SamplingParams(min_tokens=3, ignore_eos=True)]
    for generated, banned in ((0, [{1, 2, 9}, set()]), (2, [{1, 2, 9}, set()]), (3, [set(), set()])):
        batch = build_sampling_batch(params, num_output_tokens=[generated, generated], eos_token_ids=EOS)
        processed = process_logits(torch.zeros(2, VOCAB), batch.to_device(CPU, None, None))
        assert [set(torch.isinf(row).nonzero().flatten().tolist()) for row in processed] == banned


def test_penalty_counts_on_the_device_equal_a_recount():
    """Sampled tokens are counted on the device; state indices without penalties are not counted; a reused index
    restarts."""
    torch.manual_seed(0)
    penalised = SamplingParams(frequency_penalty=0.1, seed=1)
    params = [penalised, SamplingParams(), penalised, SamplingParams(repetition_penalty=1.2, temperature=0)]
    sampler = Sampler(num_states=4, vocab_size=VOCAB, device=CPU, seed=0)
    for state_index, p in enumerate(params):
        sampler.add_request(state_index, p, prompt_token_ids=[3, 4])
    batch = build_sampling_batch(params, state_indices=[0, 1, 2, 3])
    sampled = [sampler(torch.randn(4, VOCAB), batch).sampled_token_ids for _ in range(30)]
    recount = torch.stack([torch.bincount(tokens, minlength=VOCAB) for tokens in torch.stack(sampled, 1)])
    counts = sampler.penalties.output_counts
    for state_index in (0, 2, 3):
        assert torch.equal(counts[state_index], recount[state_index].int())
    assert not counts[1].any()
    sampler.release(2)
    sampler.add_request(2, penalised, prompt_token_ids=[5])
    assert not counts[2].any() and sampler.penalties.prompt_mask[2].nonzero().flatten().tolist() == [5]


def test_a_batch_without_penalties_allocates_nothing():
    sampler = Sampler(num_states=4, vocab_size=VOCAB, device=CPU, seed=0)
    params = [SamplingParams(top_p=0.9, seed=3), SamplingParams(logit_bias={1: 2.0})]
    for state_index, p in enumerate(params):
        sampler.add_request(state_index, p, prompt_token_ids=[3])
    batch = build_sampling_batch(params, state_indices=[0, 1])
    sampler(torch.randn(2, VOCAB), batch)
    assert sampler.penalties.output_counts is None and batch.penalty_rows is None
