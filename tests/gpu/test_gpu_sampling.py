"""The sampler on a CUDA GPU (run there with `pytest -m gpu tests/gpu`): the compiled paths equal the CPU reference on
fixed logits, seeded requests are unchanged by CUDA graphs, async scheduling keeps penalties exact, and start-up
leaves no sampler path to compile."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams
from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.sampling import sampler as sampler_module
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.sampler import Sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

SMALL = dict(num_kv_blocks=1024, max_num_seqs=16)  # several engines share the GPU within one test process
VOCAB = 1000
EOS = frozenset({1})
MIXED = [  # every sampler path and feature, each row its own
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.9, min_p=0.05, seed=2),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=3),
    SamplingParams(top_p=0.8),
    SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.5),
    SamplingParams(temperature=0.8, frequency_penalty=0.7, seed=4, logprobs=3),
    SamplingParams(logit_bias={5: 40.0, 6: -100.0}, seed=5),
    SamplingParams(min_tokens=3, stop_token_ids=[7], seed=6, logprobs=0),
    SamplingParams(temperature=0, logprobs=5, repetition_penalty=0.7),
    SamplingParams(temperature=1.3, top_k=4, seed=7),
]


def run_sampler(device: torch.device, logits: list[torch.Tensor], noise: list[torch.Tensor] | None) -> tuple:
    """MIXED over several steps on `device`. noise None: record every Exp(1) noise tensor drawn; else replay those
    (the generators of CPU and CUDA differ, the arithmetic on the same draws must not)."""
    kernels = resolve_kernel_choices(None, device, head_dim=64)  # an engine's on that device
    sampler = Sampler(num_states=len(MIXED), vocab_size=VOCAB, device=device, seed=0, kernels=kernels)
    if device.type == "cuda":
        sampler.warmup()  # as the worker does: the compiled paths, before any request
    recorded = []
    draw = sampler_module.exponential_noise

    def noise_source(like, *args):
        if noise is None:
            recorded.append(draw(like, *args))
            return recorded[-1]
        return noise.pop(0).to(like.device)

    sampler_module.exponential_noise = noise_source
    try:
        with torch.inference_mode():
            for state_index, params in enumerate(MIXED):
                sampler.add_request(state_index, params, prompt_token_ids=[2, 3, 3, 5])
            steps = []
            for step, step_logits in enumerate(logits):
                batch = build_sampling_batch(MIXED, range(len(MIXED)), [step] * len(MIXED), EOS)
                steps.append(sampler(step_logits.clone().to(device), batch).to_host())
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        sampler_module.exponential_noise = draw
    assert noise is None or not noise, "both runs draw the same noise, in the same order"
    return steps, recorded


def test_sampler_on_cuda_equals_the_cpu_reference():
    """Same logits, same noise: the compiled race, min-p race, truncation, penalties (counts updated on the device
    step after step), logit_bias, min_tokens and logprobs give the CPU's tokens and logprobs."""
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(len(MIXED), VOCAB, generator=generator) * 3 for _ in range(6)]
    cuda_steps, noise = run_sampler(torch.device("cuda"), logits, None)
    cpu_steps, _ = run_sampler(torch.device("cpu"), logits, [tensor.cpu() for tensor in noise])
    for cuda_output, cpu_output in zip(cuda_steps, cpu_steps, strict=True):
        assert cuda_output.sampled_token_ids.tolist() == cpu_output.sampled_token_ids.tolist()
        for cuda_tensor, cpu_tensor in zip(cuda_output.logprobs.tensors(), cpu_output.logprobs.tensors()):
            torch.testing.assert_close(cuda_tensor.cpu(), cpu_tensor, atol=1e-5, rtol=1e-5)
    tokens = torch.stack([output.sampled_token_ids.cpu() for output in cuda_steps], dim=1)
    assert (tokens[8] == 5).all() and (tokens[9, :3] != 7).all()  # logit_bias and min_tokens act on CUDA too


def mixed_requests() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [
        {"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(1, 80))]} for _ in range(12)
    ]
    params = [
        SamplingParams(temperature=0.9, seed=index, max_tokens=20, ignore_eos=True, top_k=[0, 30][index % 2],
                       min_p=[0.0, 0.05, 0.0][index % 3], repetition_penalty=[1.0, 1.3][index % 2],
                       frequency_penalty=[0.0, 0.5, 1.0][index % 3], presence_penalty=[0.5, 0.0][index % 2],
                       logprobs=2 if index % 5 == 0 else None)
        for index in range(len(prompts))
    ]  # fmt: skip
    params.append(SamplingParams(n=3, seed=50, temperature=1.0, max_tokens=16, ignore_eos=True, frequency_penalty=0.4))
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"] + [4] * 21})
    return prompts, params


def outputs(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[list[tuple]]:
    return [
        [(completion.token_ids, completion.finish_reason) for completion in output.outputs]
        for output in llm.generate(prompts, params, use_tqdm=False)
    ]


def test_seeded_penalised_requests_are_unchanged_by_graphs_and_async_scheduling(tiny_model_dirs):
    """Seeded requests with penalties, top-k, min-p, stops and n = 3: graphs with async scheduling (the CUDA default)
    give what eager synchronous steps give, and a request run alone gives what the mixed batch gives. Float32:
    bf16 rounding of other batch shapes could flip a near-tie, as in test_gpu_engine.py."""
    prompts, params = mixed_requests()
    directory = tiny_model_dirs["qwen3"]
    dtype = "float32"
    reference = LLM(directory, dtype=dtype, enforce_eager=True, async_scheduling=False, **SMALL)
    free_runs = outputs(reference, prompts, params)
    for index in range(0, len(prompts) - 1, 2):  # every other request stops at a token of its own, at its own step
        params[index] = replace(params[index], stop_token_ids=[free_runs[index][0][0][3 + index]])
    expected = outputs(reference, prompts, params)
    assert sum(completions[0][1] == "stop" for completions in expected) >= 3
    default = LLM(directory, dtype=dtype, **SMALL)
    assert default.llm_engine.async_scheduling and default.llm_engine.worker.graphs is not None
    assert outputs(default, prompts, params) == expected
    assert outputs(default, prompts[3:4], params[3:4]) == expected[3:4]
    block_manager = default.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_greedy_penalties_on_cuda_equal_the_cpu_engine(tiny_model_dirs):
    """Greedy rows with penalties and logit_bias, float32: the CUDA engine (graphs, async) takes the CPU engine's
    tokens, so the device-side counts and prompt masks are the same on both."""
    prompts, _ = mixed_requests()
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.3,
                       presence_penalty=0.2, logit_bias={11: 2.0})
    ] * len(prompts)  # fmt: skip
    directory = tiny_model_dirs["llama_gqa_untied"]
    cpu = LLM(directory, device="cpu", dtype="float32", num_kv_blocks=256)
    cuda = LLM(directory, dtype="float32", **SMALL)
    assert outputs(cuda, prompts, params) == outputs(cpu, prompts, params)


def test_start_up_leaves_no_sampler_path_to_compile(tiny_model_dirs):
    """The model's shapes are compiled by a greedy run first; then requests that use every sampler path, alone
    (one sampled row: torch.compile specialises that size) and in batches, compile nothing new."""
    from torch._dynamo.utils import counters

    llm = LLM(tiny_model_dirs["qwen3"], enable_prefix_caching=False, **SMALL)  # the same model shapes every run
    prompt = {"prompt_token_ids": list(range(2, 40))}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    llm.generate([prompt] * 5, greedy, use_tqdm=False)
    compiled = counters["stats"]["unique_graphs"]
    for params in MIXED:
        llm.generate([prompt], replace(params, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate([prompt] * 5, [replace(params, max_tokens=4, ignore_eos=True) for params in MIXED[:5]], use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == compiled
