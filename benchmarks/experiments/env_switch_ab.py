"""One of the engine's switches (an environment variable that kernel_selection reads: envs.py) off and on, in one
process: two engines of the default model on CPU, built with the variable at 0 and at 1, generate the same greedy
tokens from the same prompts in alternating rounds; the outputs must be equal. Prints each engine's median output
tok/s (the whole generate call: prompts and decoding), their paired ratio, and the load.

    python benchmarks/experiments/env_switch_ab.py --switch PAGEDLLM_CPU_FLOAT_GEMM [--weights float|gguf]
        [--threads 2] [--rounds 5] [--prompts 1] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedllm import LLM, SamplingParams

TOPICS = ["a story", "the sea", "a robot", "the moon", "a city", "a garden", "winter", "music"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", required=True, help="the variable, e.g. PAGEDLLM_CPU_FLOAT_GEMM")
    parser.add_argument("--weights", choices=["gguf", "float"], default="float")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=1, help="prompts a generate call")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    engines = {}
    for value in ("0", "1"):
        os.environ[args.switch] = value  # read when the engine resolves its kernel choices
        quantization = "auto" if args.weights == "gguf" else None
        engines[value] = LLM(device="cpu", threads=args.threads, quantization=quantization, enable_prefix_caching=False)
    prompts = [f"Write a long text about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {value: [] for value in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for value, llm in engines.items():
            start = time.perf_counter()
            result = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[value].append(sum(len(r.outputs[0].token_ids) for r in result) / elapsed)
            outputs[value] = [list(r.outputs[0].token_ids) for r in result]
    equal = sum(a == b for a, b in zip(outputs["0"], outputs["1"]))
    ratio = statistics.median(b / a for a, b in zip(rates["0"], rates["1"]))
    workload = f"{args.prompts} prompts x {args.tokens} tokens"
    print(
        f"{args.switch}, {args.weights} weights, {args.threads} threads, {workload}, {args.rounds} rounds; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"=0: {statistics.median(rates['0']):.1f} tok/s, =1: {statistics.median(rates['1']):.1f} tok/s, "
        f"paired ratio {ratio:.2f}x; outputs equal {equal}/{len(prompts)}"
    )


if __name__ == "__main__":
    main()
