"""The default model with its GGUF blocks kept, its prompt rows multiplied in float (PAGEDLLM_GGUF_FLOAT_PROMPTS=1,
the default) against the grouped-integer kernel (=0), alternating in one process, a fresh engine each run (so the
prefix cache starts empty, as in cpu_peers.py). Workloads as cpu_peers.py's: chat32 (32 chat prompts of ~40-1,000
tokens x 64 new) and nano64 (64 random prompts of U[100, 512] tokens x U[50, 256] new); generate() alone is timed.

    python benchmarks/experiments/gguf_prompt_rows_ab.py [--threads 2] [--rounds 2] [--workloads chat32 nano64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_generate import chat_prompts  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402


def workload(llm: LLM, name: str) -> tuple[list[list[int]], list[int]]:
    if name == "chat32":
        return chat_prompts(llm, 32), [64] * 32
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 512))] for _ in range(64)]
    return prompts, [rng.randint(50, 256) for _ in range(64)]


def run(name: str, float_prompts: bool, threads: int) -> float:
    os.environ["PAGEDLLM_GGUF_FLOAT_PROMPTS"] = "1" if float_prompts else "0"
    llm = LLM(threads=threads)
    prompts, lengths = workload(llm, name)
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(requests[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(output.outputs[0].token_ids) for output in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["chat32", "nano64"])
    args = parser.parse_args()
    for name in args.workloads:
        rates = {True: [], False: []}
        for _ in range(args.rounds):
            for float_prompts in (False, True):
                rate = run(name, float_prompts, args.threads)
                rates[float_prompts].append(rate)
                kind, load = "float" if float_prompts else "integer", os.getloadavg()[0]
                print(f"{name} prompt rows {kind}: {rate:.1f} tok/s (load {load:.2f})")
        ratio = statistics.median(rates[True]) / statistics.median(rates[False])
        print(f"{name}: float {statistics.median(rates[True]):.1f} / integer {statistics.median(rates[False]):.1f} "
              f"output tok/s = {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
