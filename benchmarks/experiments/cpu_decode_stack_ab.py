"""The C++ decode stack against the layers' modules, in one engine: each round generates the same greedy tokens
from the same prompt with the stack on and off in turn (the model's `decode_stack` set aside), and checks the
outputs equal. Prints decode tok/s medians and their ratio, with the load.

    python benchmarks/experiments/cpu_decode_stack_ab.py [--threads 1] [--rounds 5] [--weights gguf|float]
        [--tokens 96] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weights", choices=["gguf", "float"], default="gguf")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    llm = LLM(device="cpu", threads=args.threads, quantization="auto" if args.weights == "gguf" else None)
    model = llm.llm_engine.worker.model.model
    stack = model.decode_stack
    assert stack is not None, "the engine's kernel choices did not take the decode stack"
    topics = ["a story", "the sea", "a robot", "the moon", "a city", "a garden", "winter", "music"]
    prompts = [
        {"prompt_token_ids": llm.chat_prompt([{"role": "user", "content": f"Tell me about {topics[i % 8]}."}])[
            "prompt_token_ids"]}
        for i in range(args.batch)
    ]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {"modules": [], "stack": []}
    outputs: dict[str, list] = {}
    loads = []
    for round_index in range(args.rounds):
        with open("/proc/loadavg") as file:
            loads.append(file.read().split()[0])
        order = ("modules", "stack") if round_index % 2 == 0 else ("stack", "modules")
        for name in order:
            model.decode_stack = stack if name == "stack" else None
            started = time.perf_counter()
            result = llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(args.batch * args.tokens / (time.perf_counter() - started))
            outputs[name] = [output.outputs[0].token_ids for output in result]
    model.decode_stack = stack
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"\n{args.weights} weights, batch {args.batch}, {args.threads} thread(s), {args.rounds} rounds; "
          f"1-minute load per round: {' '.join(loads)}")  # fmt: skip
    for name, values in rates.items():
        print(f"{name:8s} median {medians[name]:6.1f} tok/s  rounds: {' '.join(f'{v:.1f}' for v in values)}")
    print(f"stack / modules: {medians['stack'] / medians['modules']:.2f}x; outputs equal: "
          f"{outputs['stack'] == outputs['modules']}")  # fmt: skip


if __name__ == "__main__":
    main()
