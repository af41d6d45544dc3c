"""Sampling end to end: greedy equivalences, per-request seeds that give the same tokens whatever the batch, the
chunking, preemption or async scheduling, and penalties, logit_bias and min_tokens against a step-by-step
reference on transformers' logits."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import VOCAB_SIZE
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12
rng = random.Random(7)
PROMPTS = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(3, 40))] for _ in range(16)]
# Four seeded requests, each on another sampler path: the race, top-k/top-p, min-p, penalties with top-k.
SEEDED = [
    SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=12, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, min_p=0.02, seed=13, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(top_k=50, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=14,
                   max_tokens=MAX_TOKENS, ignore_eos=True),
]  # fmt: skip


def prompt(index: int) -> dict:
    return {"prompt_token_ids": PROMPTS[index]}


def tokens(llm: LLM, prompts: list[dict], params) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def mixed_batch() -> tuple[list[dict], list[SamplingParams]]:
    """The four seeded requests among 12 others of other seeds and settings (unseeded, greedy, logprobs, stops)."""
    others = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.5, seed=99, max_tokens=MAX_TOKENS, logprobs=3),
        SamplingParams(temperature=1.2, top_k=5, max_tokens=3, ignore_eos=True),
        SamplingParams(min_p=0.1, seed=3, max_tokens=MAX_TOKENS, prompt_logprobs=1),
        SamplingParams(frequency_penalty=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=11, max_tokens=7, ignore_eos=True),  # another request's seed
        SamplingParams(logit_bias={5: 3.0}, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(min_tokens=4, seed=5, max_tokens=MAX_TOKENS, stop_token_ids=[7, 8, 9]),
        SamplingParams(temperature=0, repetition_penalty=2.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(n=2, seed=8, max_tokens=6, ignore_eos=True),
        SamplingParams(stop=["a"], max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    params = others[:3] + SEEDED[:2] + others[3:8] + SEEDED[2:] + others[8:]
    return [prompt(index) for index in range(len(params))], params


SEEDED_ROWS = [3, 4, 10, 11]  # where mixed_batch() puts SEEDED


@pytest.fixture(scope="module")
def alone(llama_dir) -> list[list[int]]:
    """Each seeded request run alone on a synchronous engine."""
    llm = LLM(llama_dir, async_scheduling=False, num_kv_blocks=64)
    return [tokens(llm, [prompt(row)], params)[0] for row, params in zip(SEEDED_ROWS, SEEDED)]


def test_top_k_1_and_temperature_0_are_greedy(llama_dir):
    """Greedy is transformers' greedy; top_k=1 at any temperature and tiny temperatures give the same tokens."""
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    llm = LLM(llama_dir, num_kv_blocks=64)
    prompts = [prompt(index) for index in range(4)]
    greedy = tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for batch_prompt, expected in zip(prompts, greedy):
        input_ids = torch.tensor([batch_prompt["prompt_token_ids"]])
        with torch.no_grad():
            generated = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                           max_new_tokens=MAX_TOKENS, pad_token_id=0)  # fmt: skip
        assert generated[0, input_ids.shape[1] :].tolist() == expected
    for params in (
        SamplingParams(top_k=1, temperature=1.5, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(top_k=1, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1e-6, top_p=0.5, max_tokens=MAX_TOKENS, ignore_eos=True),
    ):
        assert tokens(llm, prompts, params) == greedy, params


def test_seed_gives_the_same_tokens_in_a_batch_of_16(llama_dir, alone):
    llm = LLM(llama_dir, async_scheduling=False, num_kv_blocks=256)
    prompts, params = mixed_batch()
    batch = tokens(llm, prompts, params)
    assert [batch[row] for row in SEEDED_ROWS] == alone
    assert all(len(set(run)) > 3 for run in alone)  # they do sample


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=7),
        dict(async_scheduling=True),
        dict(async_scheduling=True, max_num_batched_tokens=7),
    ],
    ids=["chunked-7", "async", "async-chunked-7"],
)
def test_seed_survives_chunking_and_async_scheduling(llama_dir, alone, settings):
    llm = LLM(llama_dir, num_kv_blocks=256, **settings)
    prompts, params = mixed_batch()
    assert [tokens(llm, prompts, params)[row] for row in SEEDED_ROWS] == alone
    assert llm.llm_engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seed_survives_preemption(llama_dir, alone, async_scheduling):
    """A cache that holds the four prompts but not their outputs: sequences are preempted and recomputed, with
    their device-side state (generator, penalty counts) kept."""
    num_blocks = sum(-(-len(PROMPTS[row]) // 16) for row in SEEDED_ROWS)
    llm = LLM(llama_dir, num_kv_blocks=num_blocks, block_size=16, async_scheduling=async_scheduling)
    batch = tokens(llm, [prompt(row) for row in SEEDED_ROWS], SEEDED)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert batch == alone
    assert llm.llm_engine.block_manager.num_free_blocks == num_blocks


def test_different_seeds_differ(llama_dir, alone):
    llm = LLM(llama_dir, num_kv_blocks=64)
    for row, params, expected in zip(SEEDED_ROWS, SEEDED, alone):
        reseeded = replace(params, seed=params.seed + 1000)
        assert tokens(llm, [prompt(row)], reseeded)[0] != expected
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = tokens(llm, [prompt(0)] * 4, unseeded)
    assert len({tuple(run) for run in runs}) == 4  # unseeded requests draw from the engine's stream, each its own


def test_penalties_under_async_scheduling_equal_sync(llama_dir):
    """Penalty counts are updated on the device from the sampled ids, so a step queued before the previous step's
    tokens reach the host still sees them. Requests end on stop tokens, EOS and length at different steps."""
    requests = []
    for index in range(12):
        requests.append(
            SamplingParams(
                temperature=[0.0, 1.0, 0.8][index % 3], seed=index, max_tokens=MAX_TOKENS + index % 4,
                repetition_penalty=[1.0, 1.5, 0.8][index % 3], presence_penalty=[0.0, 1.0, -0.5, 2.0][index % 4],
                frequency_penalty=[0.5, 0.0, 1.5][index % 3], stop_token_ids=[7 + index] if index % 5 == 0 else None,
            )
        )  # fmt: skip
    prompts = [prompt(index) for index in range(len(requests))]
    sync = LLM(llama_dir, async_scheduling=False, num_kv_blocks=128)
    overlapped = LLM(llama_dir, async_scheduling=True, num_kv_blocks=128)
    for llm in (sync, overlapped):
        llm.llm_engine.eos_token_ids = frozenset({3})
    expected = sync.generate(prompts, requests, use_tqdm=False)
    got = overlapped.generate(prompts, requests, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in expected
    ]
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens) for p in requests]
    assert tokens(sync, prompts, plain) != [o.outputs[0].token_ids for o in expected]  # the penalties do act


def reference_greedy(model, prompt_ids: list[int], params: SamplingParams, eos: set[int]) -> list[int]:
    """Greedy decoding on transformers' logits with vLLM's definitions applied step by step: logit_bias, EOS and
    stop tokens banned below min_tokens, repetition over prompt and output, frequency, presence."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + output])).logits[0, -1].tolist()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        if len(output) < params.min_tokens:
            for token in set(params.stop_token_ids) | eos:
                logits[token] = -math.inf
        counts = Counter(output)
        for token in range(len(logits)):
            if token in counts or token in prompt_ids:
                penalty = params.repetition_penalty
                logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
            logits[token] -= params.frequency_penalty * counts[token] + params.presence_penalty * (counts[token] > 0)
        token = max(range(len(logits)), key=logits.__getitem__)
        output.append(token)
        if len(output) >= params.min_tokens and (token in eos or token in params.stop_token_ids):
            break
    return output


def test_penalties_bias_and_min_tokens_equal_a_reference_on_transformers(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    base = dict(temperature=0, max_tokens=10)
    free_run = reference_greedy(model, PROMPTS[2], SamplingParams(**base), eos=set())
    eos = free_run[1]  # the model's second token: without min_tokens the request would end there
    cases = [
        SamplingParams(**base, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(**base, repetition_penalty=0.6, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(**base, presence_penalty=1.5, frequency_penalty=-0.3, ignore_eos=True),
        SamplingParams(**base, logit_bias={free_run[0]: -100.0, 17: 5.0}, ignore_eos=True),
        SamplingParams(**base, min_tokens=6),  # EOS is held back until 6 tokens
        SamplingParams(**base, min_tokens=5, stop_token_ids=[free_run[2], free_run[3]], ignore_eos=True),
    ]
    llm = LLM(llama_dir, num_kv_blocks=64)
    llm.llm_engine.eos_token_ids = frozenset({eos})
    outputs = llm.generate([prompt(2)] * len(cases), cases, use_tqdm=False)
    for params, output in zip(cases, outputs):
        expected = reference_greedy(model, PROMPTS[2], params, eos=set() if params.ignore_eos else {eos})
        assert output.outputs[0].token_ids == expected, params
    assert outputs[4].outputs[0].token_ids != free_run[:2] and len(outputs[4].outputs[0].token_ids) >= 6


def test_the_models_generation_config_gives_the_default_sampling_params(llama_dir, tmp_path):
    """vLLM's generation_config="auto": get_default_sampling_params() and generate(..., None) take the sampling
    values of generation_config.json (top_k 1 here: greedy tokens at temperature 0.6); a model without them gets
    SamplingParams()."""
    import json
    import shutil

    model = shutil.copytree(llama_dir, tmp_path / "model")
    generation_config = json.loads((model / "generation_config.json").read_text())
    generation_config |= {"do_sample": True, "temperature": 0.6, "top_k": 1}
    (model / "generation_config.json").write_text(json.dumps(generation_config))
    llm = LLM(str(model), num_kv_blocks=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.6, 1, 16)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    assert tokens(llm, [prompt(0), prompt(1)], None) == tokens(llm, [prompt(0), prompt(1)], greedy)
    llm.shutdown()
    assert LLM(llama_dir, num_kv_blocks=16).get_default_sampling_params() == SamplingParams()
