"""The README's Python snippet's speed by thread count: `python snippet_threads.py default|N` (the default model, two
prompts x 64 greedy tokens, timed after one warm-up generate). Run it with and without a busy core elsewhere."""

from __future__ import annotations

import sys
import time

import torch

from pagedllm import LLM, SamplingParams

threads = None if sys.argv[1] == "default" else int(sys.argv[1])
llm = LLM() if threads is None else LLM(threads=threads)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
prompts = ["The capital of France is", "Paged attention is"]
llm.generate(prompts, params, use_tqdm=False)
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(sys.argv[1], torch.get_num_threads(), f"{128 / (time.perf_counter() - start):.1f} tok/s")
