"""The sampler's cost per step for a batch of rows x vocab, per feature mix: a feature no row uses should cost nothing.

Run: python benchmarks/sampler_cost.py [--device cpu] [--rows 256] [--vocab 151936] [--repeats 5] [--threads 2]
Prints one line per mix: median milliseconds of the sampler call, and of building the host-side batch.

--engine (GPU): the whole decode step instead, in the engine with CUDA graphs and async scheduling, on random
Qwen3-0.6B weights: --rows requests of 512 random prompt tokens decode 96 tokens each with every row using the mix;
prints the median decode-step time per mix (from the engine's step records), so a feature's cost is read against
the step it is part of.

"temperature only (fused kernel)" runs its batch through the Triton race (kernels/race_sampling.py) and every other
mix through the torch path (the sampler's kernel choice, set per mix), whatever PAGEDLLM_FUSED_SAMPLER says, so the
two are compared in one run (CUDA only).
Leave PAGEDLLM_FUSED_SAMPLER unset (on) for --engine so that start-up compiles the kernel, as it does for a user.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.layers.kernel_choices import KernelChoices
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler

EOS = frozenset({0})
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
ALL_FEATURES = dict(
    temperature=0.8,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    **PENALTIES,
    logit_bias={token: 1.0 for token in range(1, 11)},
    min_tokens=200,  # still below: EOS is banned
    logprobs=5,
    max_tokens=1000,
)
MIXES = {  # name: each row's SamplingParams given its row index
    "greedy": lambda row: SamplingParams(temperature=0),
    "temperature only": lambda row: SamplingParams(temperature=0.8),
    "temperature only (fused kernel)": lambda row: SamplingParams(temperature=0.8),
    "temperature, every row seeded": lambda row: SamplingParams(temperature=0.8, seed=row),
    "top_k 50 + top_p 0.9 (topk path)": lambda row: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p 0.9 (full sort)": lambda row: SamplingParams(temperature=0.8, top_p=0.9),
    "min_p 0.05": lambda row: SamplingParams(temperature=0.8, min_p=0.05),
    "penalties (3 kinds)": lambda row: SamplingParams(**PENALTIES),
    "logprobs 5": lambda row: SamplingParams(temperature=0.8, logprobs=5),
    "all features, unseeded": lambda row: SamplingParams(**ALL_FEATURES),
    "all features, every row seeded": lambda row: SamplingParams(**ALL_FEATURES, seed=row),
}

FUSED_MIXES = {"temperature only (fused kernel)"}  # sampled by the Triton race kernel (CUDA)


def with_race(kernels: KernelChoices, fused: bool) -> KernelChoices:
    """`kernels` with the fused race kernel on or off."""
    return dataclasses.replace(kernels, sampler="triton_race" if fused else "torch")


@contextlib.contextmanager
def fused_race(sampler: Sampler, on: bool):
    """The sampler's choice of the fused race kernel, set for one mix."""
    previous = sampler.kernels
    sampler.kernels = with_race(previous, on)
    try:
        yield
    finally:
        sampler.kernels = previous


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    params = [MIXES[name](row) for row in range(args.rows)]
    kernels = with_race(resolve_kernel_choices(None, device, head_dim=128), name in FUSED_MIXES)  # an engine's
    sampler = Sampler(num_states=args.rows, vocab_size=args.vocab, device=device, seed=0, kernels=kernels)
    generator = torch.Generator().manual_seed(0)
    for state_index, p in enumerate(params):  # a 512-token prompt each, then 64 sampled tokens counted for penalties
        sampler.add_request(state_index, p, torch.randint(args.vocab, (512,), generator=generator).tolist())
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3).to(device)
    state_indices, num_output_tokens = list(range(args.rows)), [64] * args.rows
    batch = build_sampling_batch(params, state_indices, num_output_tokens, EOS)
    penalties = batch.to_device(device, sampler.generators.__getitem__, None, kernels.pin_memory).penalties
    for _ in range(64 if penalties is not None else 0):
        sampler.penalties.update(penalties, torch.randint(args.vocab, (args.rows,), generator=generator).to(device))
    sampler(logits.clone(), batch)  # warm-up
    sampler_ms, build_ms = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        batch = build_sampling_batch(params, state_indices, num_output_tokens, EOS)
        build_ms.append((time.perf_counter() - start) * 1e3)
        step_logits = logits.clone()
        synchronize(device)
        start = time.perf_counter()
        sampler(step_logits, batch)
        synchronize(device)
        sampler_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(sampler_ms), statistics.median(build_ms)


def decode_step_ms(llm, params: list[SamplingParams], prompts: list[list[int]]) -> float:
    """Median interval between consecutive decode-only steps' tokens reaching the host, over one batch."""
    engine = llm.llm_engine
    resolved: list[tuple[int, float]] = []
    listener = lambda record: resolved.append((record.num_prefill_tokens, record.resolved_at))  # noqa: E731
    engine.add_step_listener(listener)
    try:
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"cost-{index}", {"prompt_token_ids": prompt}, p, stream=False)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.remove_step_listener(listener)
    intervals = [(now - before) * 1e3 for (_, before), (prefill, now) in zip(resolved, resolved[1:]) if prefill == 0]
    return statistics.median(intervals[len(intervals) // 4 :])  # skip the steps right after the prefills


def engine_mode(args: argparse.Namespace) -> None:
    from pathlib import Path

    from pagedllm import LLM
    from pagedllm.entrypoints.bench_common import write_random_checkpoint

    checkpoint = Path("/tmp/pagedllm-bench/qwen3-0.6b")
    if not (checkpoint / "model.safetensors").exists():
        write_random_checkpoint("qwen3-0.6b", checkpoint, torch.device("cuda"))
    llm = LLM(str(checkpoint), max_model_len=4096, skip_tokenizer_init=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 10_000, (512,), generator=generator).tolist() for _ in range(args.rows)]
    names = args.only or list(MIXES)
    print(f"decode step of {args.rows} sequences (512-token prompts, 96 tokens out), Qwen3-0.6B shape, median of")
    print(f"the later 3/4 of the decode steps, {args.repeats} rounds over the mixes; the median round shown")
    steps: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            params = [
                dataclasses.replace(p, max_tokens=96, ignore_eos=True, min_tokens=min(p.min_tokens, 96))
                for p in (MIXES[name](row) for row in range(args.rows))
            ]
            with fused_race(llm.llm_engine.worker.sampler, name in FUSED_MIXES):
                steps[name].append(decode_step_ms(llm, params, prompts))
            llm.reset_prefix_cache()
    base = statistics.median(steps[names[0]])
    print(f"| {'mix':<34} | decode step ms | vs {names[0]} |")
    print(f"| {'-' * 34} | -------------- | ---------- |")
    for name in names:
        ms = statistics.median(steps[name])
        print(f"| {name:<34} | {ms:14.2f} | {ms / base:10.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these mixes (names as printed)")
    parser.add_argument("--engine", action="store_true", help="time the whole decode step in the engine (GPU)")
    args = parser.parse_args()
    if args.engine:
        return engine_mode(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    print(f"{args.rows} rows x vocab {args.vocab} on {device}, {threads} threads, median of {args.repeats}")
    print(f"| {'mix':<34} | sampler ms | host batch ms |")
    print(f"| {'-' * 34} | ---------- | ------------- |")
    for name in args.only or MIXES:
        if name in FUSED_MIXES and device.type != "cuda":
            continue  # the kernel runs on CUDA only
        sampler_ms, build_ms = measure(name, args, device)
        print(f"| {name:<34} | {sampler_ms:10.2f} | {build_ms:13.2f} |", flush=True)


if __name__ == "__main__":
    main()
