"""The fused race kernel compiled on a CUDA GPU (run there with `pytest -m gpu tests/gpu`): its draws follow
softmax(logits / T) at Qwen3's vocabulary size, and an engine with the switch on (the default;
PAGEDLLM_FUSED_SAMPLER, set here before each engine starts, which reads it) keeps greedy and seeded requests'
tokens and compiles at start-up."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import race_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

VOCAB = 151_936  # 38 chunks of 4096 columns, the last one 384 wide
# Chunk 0's first and last columns' neighbours, chunk 1's first, the middle, the partial chunk's first and last
HEAVY = {7: 2.0, 4095: 1.2, 4096: 1.6, 77_777: 0.8, 151_552: 0.4, 151_935: 1.0}
BACKGROUND = -10.0  # the other 151,930 tokens: no mass at T = 0.6, 93% of it at T = 1.5
ROWS, CALLS = 2048, 8  # 16,384 draws per temperature
# Total variation over the heavy tokens and "any other": sampling error 0.006 on average, 0.016 at the 99.99%
# quantile (simulated). Wrong kernels are >= 0.28 away: no temperature, or the noise added before the division
# (0.28 at T = 0.6, 0.70 at T = 1.5), logits * T (>= 0.93).
TV_BOUND = 0.03
CHUNK_TV_BOUND = 0.05  # the background draws over the 38 chunks: ~0.02 of sampling error at ~15,000 draws
SMALL = dict(num_kv_blocks=1024, max_num_seqs=16)


def heavy_and_rest(distribution: torch.Tensor) -> torch.Tensor:
    heavy = distribution[list(HEAVY)]
    return torch.cat([heavy, 1.0 - heavy.sum(dim=0, keepdim=True)])


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_draws_follow_the_softmax_at_the_real_vocabulary_size(temperature: float) -> None:
    logits = torch.full((VOCAB,), BACKGROUND, dtype=torch.float64)
    logits[list(HEAVY)] = torch.tensor(list(HEAVY.values()), dtype=torch.float64)
    target = (logits / temperature).softmax(dim=0)
    batch = logits.float().cuda().repeat(ROWS, 1)
    temperatures = torch.full((ROWS,), temperature, device="cuda")
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    tokens = []
    for call in range(CALLS):
        tokens.append(race_sampling.race_sample(batch, temperatures, seed + call))
    tokens = torch.cat(tokens).cpu()
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / len(tokens)
    assert total_variation(heavy_and_rest(frequencies), heavy_and_rest(target)) < TV_BOUND
    background = tokens[~torch.isin(tokens, torch.tensor(list(HEAVY)))]
    if len(background) > 10_000:  # T = 1.5: the background's draws spread over the chunks as its columns do
        chunk_size = race_sampling.BLOCK_SIZE
        columns_per_chunk = torch.bincount(torch.arange(VOCAB) // chunk_size).double()
        columns_per_chunk -= torch.bincount(torch.tensor(list(HEAVY)) // chunk_size, minlength=len(columns_per_chunk))
        drawn = torch.bincount(background // chunk_size, minlength=len(columns_per_chunk)).double()
        assert total_variation(drawn / drawn.sum(), columns_per_chunk / columns_per_chunk.sum()) < CHUNK_TV_BOUND


def specialisations() -> set:
    """The fused kernel's compiled variants (as benchmarks/first_run_probe.py counts them)."""
    caches = getattr(race_sampling._race_chunk_kernel, "device_caches", {})
    return {key for cache in caches.values() for key in cache[0]}


def test_engine_with_the_fused_race_keeps_greedy_and_seeded_tokens(tiny_model_dirs, monkeypatch) -> None:
    """Greedy, unseeded and seeded requests in one batch, float32 (as test_gpu_sampling.py). While a seeded row is
    in the batch it runs the torch race; once the seeded requests finish, the fused kernel samples the others, greedy
    rows included. Greedy and seeded requests get the tokens they get with the switch off; no step compiles."""
    rng = random.Random(5)
    prompts = [
        {"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(3, 60))]} for _ in range(9)
    ]

    def request(index: int) -> SamplingParams:
        if index % 3 == 0:
            return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        if index % 3 == 1:
            return SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
        return SamplingParams(temperature=0.9, seed=index, max_tokens=6, ignore_eos=True)  # finishes first

    params = [request(index) for index in range(len(prompts))]
    kept = [index for index, p in enumerate(params) if p.temperature == 0 or p.seed is not None]

    def generate(llm: LLM) -> list[list[int]]:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setenv("PAGEDLLM_FUSED_SAMPLER", "0")  # read when the engine resolves its kernel choices
    torch_path = LLM(tiny_model_dirs["qwen3"], dtype="float32", **SMALL)
    assert torch_path.llm_engine.worker.kernels.sampler == "torch"
    reference = generate(torch_path)
    del torch_path  # one engine on the GPU at a time
    monkeypatch.setenv("PAGEDLLM_FUSED_SAMPLER", "1")
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32", **SMALL)  # Sampler.warmup compiles the kernel
    assert llm.llm_engine.worker.kernels.sampler == "triton_race"
    compiled = specialisations()
    assert compiled
    calls = []
    race_sample = race_sampling.race_sample
    monkeypatch.setattr(race_sampling, "race_sample", lambda *args: calls.append(1) or race_sample(*args))
    fused = generate(llm)
    assert calls, "the steps after the seeded requests finished ran the fused kernel"
    assert [fused[index] for index in kept] == [reference[index] for index in kept]
    assert all(len(tokens) == p.max_tokens for tokens, p in zip(fused, params))
    assert specialisations() == compiled
