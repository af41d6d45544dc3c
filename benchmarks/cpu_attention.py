"""CPU decode attention, one layer's call: the cpu backend (rows over the paged cache in place, C++) against the torch
backend (each row's context gathered, then SDPA), the default model's heads (9 query, 3 KV, head_dim 64), block size
16, shuffled blocks. Interleaved rounds, the best of each; prints one table with the ratio and the load.

Run: python benchmarks/cpu_attention.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from pagedllm import cpu_kernels
from pagedllm.attention import cpu_backend, torch_backend
from pagedllm.attention.fp8 import quantize_fp8
from pagedllm.attention.metadata import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = [  # (rows, context: a length, or (low, high) drawn per row)
    (1, 100), (1, 1000), (32, 100), (32, 1000), (32, (100, 1000)), (64, (100, 1000)),
]  # fmt: skip
CACHES = ("float32", "bfloat16", "fp8 (float32 queries)")


def decode_step(rows: int, context, cache: str, generator: torch.Generator):
    """(query, k_cache, v_cache, metadata, k_scale, v_scale) of a decode step over random shuffled blocks."""
    lens = (
        [context] * rows if isinstance(context, int) else torch.randint(*context, (rows,), generator=generator).tolist()
    )
    width = -(-max(lens) // BLOCK_SIZE)
    tables = torch.randperm(rows * width, generator=generator).view(rows, width).int()
    shape = (rows * width, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    k, v = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    scales = (None, None)
    if cache.startswith("fp8"):
        (k, k_scale), (v, v_scale) = quantize_fp8(k), quantize_fp8(v)
        scales = (k_scale.transpose(1, 2).contiguous(), v_scale.transpose(1, 2).contiguous())
    metadata = AttentionMetadata(
        slot_mapping=torch.full((rows,), -1),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(lens),
        decode_only=True,
        decoding=np.ones(rows, np.int32),
    )
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return query, k, v, metadata, *scales


def time_call(attention, step, repeats: int = 5) -> float:
    """Microseconds a call, the layout derived anew each time (as each step does)."""
    query, k, v, metadata, k_scale, v_scale = step
    start = time.perf_counter()
    for _ in range(repeats):
        metadata.derived.clear()
        attention(query, k, v, metadata, HEAD_DIM**-0.5, k_scale, v_scale)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.require()
    backends = {"torch": torch_backend.paged_attention, "cpu": cpu_backend.paged_attention}
    generator = torch.Generator().manual_seed(0)
    steps = {(rows, context, cache): decode_step(rows, context, cache, generator)
             for cache in CACHES for rows, context in CASES}  # fmt: skip
    best = {(key, name): float("inf") for key in steps for name in backends}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for key, step in steps.items():
            for name, attention in backends.items():
                best[key, name] = min(best[key, name], time_call(attention, step))
    load = f"{min(loads):.2f}-{max(loads):.2f}"
    print(f"{args.threads} threads, best of {args.rounds} interleaved rounds; 1-minute load {load}")
    print("| rows | context | cache | torch backend us | cpu backend us | cpu / torch |")
    print("|---|---|---|---|---|---|")
    for rows, context, cache in steps:
        torch_us, cpu_us = best[(rows, context, cache), "torch"], best[(rows, context, cache), "cpu"]
        span = context if isinstance(context, int) else f"{context[0]}-{context[1]}"
        print(f"| {rows} | {span} | {cache} | {torch_us:.0f} | {cpu_us:.0f} | {cpu_us / torch_us:.2f} |")


if __name__ == "__main__":
    main()
