"""`pagedllm bench --latency`: how fast one user is served, on random weights of a model's shape.

Three figures, each after start-up and one earlier request (so nothing is measured cold):
- one sequence, 512 prompt tokens, 512 output tokens: milliseconds per output token over the decode steps;
- one sequence decoding with a 32,000-token context: milliseconds per output token;
- a batch of 8 fresh 128-token prompts, a shape the engine has not run before: time to the first token.
"""

from __future__ import annotations

import random
import time

from pagedllm import LLM, SamplingParams

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


def run_latency(checkpoint: str, max_positions: int, **engine_kwargs) -> dict:
    """The 32,000-token row runs only where the model's positions allow it."""
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
    llm_shutdown = getattr(llm, "shutdown", None)
    if llm_shutdown is not None:
        llm_shutdown()
    return result
