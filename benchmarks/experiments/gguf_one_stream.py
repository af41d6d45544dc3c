"""One stream on the default model, the weight formats side by side in one process (tighter interleaving than
cpu_weights.py's processes when the machine's load drifts): GGUF blocks kept, oneDNN float weights, aten::mm float
weights; each round generates 64 greedy tokens from the same prompt with each engine in turn. Prints medians.

    python benchmarks/experiments/gguf_one_stream.py [--threads 1] [--rounds 5] [--dtype float32]
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
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engines = {}
    for name, quantization, onednn in (("kept", "auto", "1"), ("oneDNN", None, "1"), ("aten::mm", None, "0")):
        os.environ["PAGEDLLM_ONEDNN_LINEAR"] = onednn  # read when the engine resolves its kernels
        engines[name] = LLM(dtype=args.dtype, device="cpu", quantization=quantization, threads=args.threads)
    prompt = [{"prompt_token_ids": engines["kept"].chat_prompt([{"role": "user", "content": "Tell me a story."}])[
        "prompt_token_ids"]}]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    loads = []
    for _ in range(args.rounds):
        with open("/proc/loadavg") as file:
            loads.append(file.read().split()[0])
        for name, llm in engines.items():
            started = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            rates[name].append(64 / (time.perf_counter() - started))
    print(f"\n{args.dtype}, {args.threads} thread(s), {args.rounds} rounds; 1-minute load per round: {' '.join(loads)}")
    print("| weights | output tok/s (median) | each round |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{value:.1f}' for value in values)} |")


if __name__ == "__main__":
    main()
