"""The sampler's cost per step for a batch of rows x vocab, per feature mix: a feature no row uses should cost nothing.

Run: python benchmarks/sampler_cost.py [--device cpu] [--rows 256] [--vocab 151936] [--repeats 5] [--threads 2]
Prints one line per mix: median milliseconds of the sampler call, and of building the host-side batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.sampler import Sampler
from pagedllm.layers.sampling_batch import build_sampling_batch
from pagedllm.sampling_params import SamplingParams

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
    "temperature, every row seeded": lambda row: SamplingParams(temperature=0.8, seed=row),
    "top_k 50 + top_p 0.9 (topk path)": lambda row: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p 0.9 (full sort)": lambda row: SamplingParams(temperature=0.8, top_p=0.9),
    "min_p 0.05": lambda row: SamplingParams(temperature=0.8, min_p=0.05),
    "penalties (3 kinds)": lambda row: SamplingParams(**PENALTIES),
    "logprobs 5": lambda row: SamplingParams(temperature=0.8, logprobs=5),
    "all features, unseeded": lambda row: SamplingParams(**ALL_FEATURES),
    "all features, every row seeded": lambda row: SamplingParams(**ALL_FEATURES, seed=row),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    params = [MIXES[name](row) for row in range(args.rows)]
    sampler = Sampler(num_slots=args.rows, vocab_size=args.vocab, device=device, seed=0)
    generator = torch.Generator().manual_seed(0)
    for slot, p in enumerate(params):  # a 512-token prompt each, then 64 sampled tokens counted for penalties
        sampler.add_request(slot, p, torch.randint(args.vocab, (512,), generator=generator).tolist())
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3).to(device)
    slots, num_output_tokens = list(range(args.rows)), [64] * args.rows
    batch = build_sampling_batch(params, slots, num_output_tokens, EOS)
    penalties = batch.to_device(device, sampler.generators.__getitem__, None).penalties
    for _ in range(64 if penalties is not None else 0):
        sampler.penalties.update(penalties, torch.randint(args.vocab, (args.rows,), generator=generator).to(device))
    sampler(logits.clone(), batch)  # warm-up
    sampler_ms, build_ms = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        batch = build_sampling_batch(params, slots, num_output_tokens, EOS)
        build_ms.append((time.perf_counter() - start) * 1e3)
        step_logits = logits.clone()
        synchronize(device)
        start = time.perf_counter()
        sampler(step_logits, batch)
        synchronize(device)
        sampler_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(sampler_ms), statistics.median(build_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these mixes (names as printed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    print(f"{args.rows} rows x vocab {args.vocab} on {device}, {threads} threads, median of {args.repeats}")
    print(f"| {'mix':<34} | sampler ms | host batch ms |")
    print(f"| {'-' * 34} | ---------- | ------------- |")
    for name in args.only or MIXES:
        sampler_ms, build_ms = measure(name, args, device)
        print(f"| {name:<34} | {sampler_ms:10.1f} | {build_ms:13.2f} |", flush=True)


if __name__ == "__main__":
    main()
