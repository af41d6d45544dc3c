"""`pagedllm bench --latency`: how fast one user is served, on random weights of a model's shape.

Three figures, each after start-up and one earlier request (so nothing is measured cold):
- one sequence, 512 prompt tokens, 512 output tokens: milliseconds per output token over the decode steps;
- one sequence decoding with a 32,000-token context: milliseconds per output token;
- a batch of 8 fresh 128-token prompts, a shape the engine has not run before: time to the first token.
"""

from __future__ import annotations

import random
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_common import device_time_per_step

LONG_CONTEXT = 32_000


def random_prompt(rng: random.Random, length: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(10, 10_000) for _ in range(length)]}


def decode_ms_per_token(llm: LLM, prompt: dict, num_tokens: int) -> float:
    """Mean wall time per decode step (steps after the first token), read from the engine's step records."""
    engine = llm.llm_engine
    resolved: list[tuple[int, float]] = []
    listener = lambda record: resolved.append((record.num_decode_tokens, record.resolved_at))  # noqa: E731
    engine.add_step_listener(listener)
    try:
        params = SamplingParams(temperature=0.6, max_tokens=num_tokens, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)
    finally:
        engine.remove_step_listener(listener)
    decode_times = [t for n, t in resolved if n]
    return 1e3 * (decode_times[-1] - decode_times[0]) / (len(decode_times) - 1)


def time_to_first_token(llm: LLM, prompts: list[dict]) -> float:
    engine = llm.llm_engine
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"ttft-{index}", prompt, SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(output.outputs[0].token_ids for output in outputs):
            first = time.perf_counter() - start
    return first


def profile_one_sequence(llm: LLM, rng: random.Random, num_steps: int = 20) -> dict:
    """Where one sequence's decode step goes: a torch.profiler table of num_steps decode steps, and the device
    kernels launched per step (inside the CUDA graph too)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.6, max_tokens=4 * num_steps, ignore_eos=True)
    engine.add_request("profile", random_prompt(rng, 512), params)
    while not any(output.outputs[0].token_ids for output in engine.step()):
        pass
    engine.step()  # the first decode steps are queued: profile steady steps only
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        elapsed = time.perf_counter() - start
    engine.abort_request("profile")
    while engine.has_unfinished_requests():
        engine.step()
    result = {"profiled_ms_per_step": 1e3 * elapsed / num_steps} | device_time_per_step(profiler, num_steps)
    print(
        f"\nprofiled one-sequence decode: {result['profiled_ms_per_step']:.2f} ms/step under the profiler, "
        f"{result['kernels_per_step']:.0f} device kernels per step, {result['kernel_ms_per_step']:.3f} ms of kernel "
        f"time per step, of which all-reduce {result['all_reduce_ms_per_step']:.3f} ms"
    )
    print(profiler.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=70))
    return result


def profile_first_token(llm: LLM, prompts: list[dict]) -> None:
    """Where the time to the first token of a fresh batch goes: host (self CPU time) and device, under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        ttft = time_to_first_token(llm, prompts)
    print(f"\nprofiled first token of {len(prompts)} fresh prompts: {1e3 * ttft:.1f} ms under the profiler")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def run_latency(checkpoint: str, max_positions: int, profile: bool = False, **engine_kwargs) -> dict:
    """The 32,000-token row runs only where the model's positions allow it; profile: then a profile of one
    sequence's decode steps (kernels per step, the kernel table)."""
    rng = random.Random(0)
    long_context = max_positions >= LONG_CONTEXT + 1024
    max_model_len = LONG_CONTEXT + 1024 if long_context else min(max_positions, 4096)
    llm = LLM(checkpoint, max_model_len=max_model_len, skip_tokenizer_init=True, **engine_kwargs)
    decode_ms_per_token(llm, random_prompt(rng, 64), 16)  # one earlier request
    result = {"one_sequence_512_in_512_out_ms_per_token": decode_ms_per_token(llm, random_prompt(rng, 512), 512)}
    if long_context:
        long_prompt = random_prompt(rng, LONG_CONTEXT)
        result["one_sequence_32k_context_ms_per_token"] = decode_ms_per_token(llm, long_prompt, 256)
    fresh = [random_prompt(rng, 128) for _ in range(8)]
    result["eight_fresh_128_token_prompts_ttft_s"] = time_to_first_token(llm, fresh)
    print("| latency | value |\n|---|---|")
    print(f"| one sequence, 512 in / 512 out | {result['one_sequence_512_in_512_out_ms_per_token']:.2f} ms/token |")
    if long_context:
        long_ms = result["one_sequence_32k_context_ms_per_token"]
        print(f"| one sequence, 32,000-token context | {long_ms:.2f} ms/token |")
    print(f"| 8 fresh 128-token prompts, first token | {1e3 * result['eight_fresh_128_token_prompts_ttft_s']:.0f} ms |")
    if profile:
        result["profile"] = profile_one_sequence(llm, rng)
        profile_first_token(llm, [random_prompt(rng, 128) for _ in range(8)])
    llm.shutdown()
    return result
