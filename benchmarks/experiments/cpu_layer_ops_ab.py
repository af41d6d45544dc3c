"""The CPU layer ops (layers/cpu_layer_ops.cpp) against the torch expressions, one engine of each in one process,
alternating: one stream of the default model (64 greedy tokens from one chat prompt), and a batch of chat prompts.
Prints each round's tok/s, the medians, the load, and whether the two engines' tokens agree.

    python benchmarks/experiments/cpu_layer_ops_ab.py [--threads 1] [--rounds 5] [--quantization auto|none]
        [--dtype float32] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    engines = {}
    for name, switch in (("torch ops", "0"), ("C++ ops", "1")):
        os.environ["PAGEDLLM_CPU_LAYER_OPS"] = switch  # read when the engine resolves its kernels
        engines[name] = LLM(dtype=args.dtype, device="cpu", quantization=quantization, threads=args.threads)
    first = next(iter(engines.values()))
    topics = ["the sea", "a robot", "prime numbers", "coffee", "the moon", "Python", "Paris", "a storm"]
    prompts = [
        {
            "prompt_token_ids": first.chat_prompt([{"role": "user", "content": f"Tell me about {topics[i % 8]}."}])[
                "prompt_token_ids"
            ]
        }  # fmt: skip
        for i in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    workloads = {"one stream": prompts[:1], f"{args.batch} chats": prompts}
    rates = {(w, n): [] for w in workloads for n in engines}
    tokens = {}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for workload, batch in workloads.items():
            for name, llm in engines.items():
                started = time.perf_counter()
                outputs = llm.generate(batch, params, use_tqdm=False)
                rates[workload, name].append(64 * len(batch) / (time.perf_counter() - started))
                tokens[workload, name] = [o.outputs[0].token_ids for o in outputs]
    print(f"\n{args.dtype}, quantization {args.quantization}, {args.threads} thread(s), {args.rounds} rounds; "
          f"1-minute load per round: {' '.join(f'{load:.2f}' for load in loads)}")  # fmt: skip
    for workload in workloads:
        medians = {name: statistics.median(rates[workload, name]) for name in engines}
        same = sum(a == b for a, b in zip(*(tokens[workload, name] for name in engines)))
        ratio = medians["C++ ops"] / medians["torch ops"]
        rates_text = ", ".join(f"{name} {median:.1f} tok/s" for name, median in medians.items())
        print(f"{workload}: {rates_text}; ratio {ratio:.2f}x; outputs equal {same}/{len(workloads[workload])}")
        for name in engines:
            print(f"  {name}: " + " ".join(f"{rate:.1f}" for rate in rates[workload, name]))


if __name__ == "__main__":
    main()
