"""Accuracy of the GGUF blocks kept quantized (layers/quantization/gguf.py) against the same file dequantized to
float32, measured, not assumed: the embedded SmolLM2-135M (Q4_1 layers), benchmarks/cpu_generate.py's 32 chat
prompts, greedy, 64 new tokens.

Prints (1) greedy agreement of the engine as it serves (kept blocks, float32 model) with the dequantized float32
engine: tokens equal before each prompt's first divergence, sequences identical (near ties decide some: reported,
not asserted); (2) teacher-forced over the dequantized run's outputs (prompt + output in one forward, as
benchmarks/fp8_accuracy.py does), the mean absolute change of the chosen tokens' logprobs and the share of
positions whose top token changes, in a float32 model and a bfloat16 one; and for scale the bfloat16 model on
dequantized weights.

    python benchmarks/gguf_accuracy.py [--threads 1] [--num-prompts 32] [--new-tokens 64] [--float32-only]

--float32-only skips the two bfloat16 models (their prompts run ~10x slower on a CPU without native bfloat16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from cpu_generate import chat_prompts  # noqa: E402
from fp8_accuracy import agreement_before_divergence, generate, teacher_forced_logprobs  # noqa: E402

from pagedllm import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--float32-only", action="store_true")
    args = parser.parse_args()
    common = {"device": "cpu", "enable_prefix_caching": False, "threads": args.threads}
    reference = LLM(dtype="float32", quantization=None, **common)
    kept = LLM(dtype="float32", **common)
    prompts = chat_prompts(reference, args.num_prompts)
    outputs = generate(reference, prompts, args.new_tokens)
    served = generate(kept, prompts, args.new_tokens)
    others = {"kept blocks, float32 model": kept}
    if not args.float32_only:
        others["kept blocks, bfloat16 model"] = LLM(dtype="bfloat16", **common)
        others["dequantized, bfloat16 model (for scale)"] = LLM(dtype="bfloat16", quantization=None, **common)
    changes = {name: [] for name in others}
    flips = dict.fromkeys(others, 0)
    for prompt, output in zip(prompts, outputs, strict=True):
        chosen = torch.tensor(output)
        base = teacher_forced_logprobs(reference, prompt, output)[torch.arange(len(output)), chosen]
        for name, llm in others.items():
            logprobs = teacher_forced_logprobs(llm, prompt, output)
            changes[name].append((logprobs[torch.arange(len(output)), chosen] - base).abs())
            flips[name] += int((logprobs.argmax(-1) != chosen).sum())
    positions = sum(map(len, outputs))
    lengths = sorted(map(len, prompts))
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF: {len(prompts)} chat prompts ({lengths[0]}-{lengths[-1]} tokens), "
          f"greedy, {args.new_tokens} new tokens; against the file dequantized to float32 (float32 model)")  # fmt: skip
    print("| measure | value |\n|---|---|")
    same = agreement_before_divergence(outputs, served)
    identical = sum(a == b for a, b in zip(outputs, served, strict=True))
    print(f"| served (kept blocks, float32): tokens equal before the first divergence | {same:.1%} |")
    print(f"| served (kept blocks, float32): sequences identical | {identical} of {len(prompts)} |")
    for name in others:
        change = torch.cat(changes[name])
        print(f"| {name}: teacher-forced mean abs change of the chosen logprob | {change.mean():.4f} "
              f"(max {change.max():.3f}) |")  # fmt: skip
        print(f"| {name}: teacher-forced positions whose top token changes | {flips[name] / positions:.2%} |")


if __name__ == "__main__":
    main()
