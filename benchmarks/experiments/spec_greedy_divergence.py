"""Does n-gram speculation change a greedy output of the default model? Each of speculative.py's 20 copy-heavy
prompts alone, greedy, with and without speculation; prints the prompts whose outputs differ and the first position
where they do. With --quantization none the weights are float32; by default the GGUF blocks are kept in 4 bits.

Found in session 18 (benchmarks/NOTES.md, "Speculation changes greedy outputs"): with the blocks kept, 5 of 20
prompts differ (k = 3, 96 tokens); with float32 weights none. The int4 kernel is row-invariant, and chunked prefill
changes nothing. Below it: CPU SDPA's bits for a row depend on the key length it is padded to, so a row's attention
output differs in the last bits between a verify step, a decode step alone and a decode step in a batch; the kept
blocks' bfloat16 activations now and then round such bits differently, which flips near-tied greedy tokens.

    python benchmarks/experiments/spec_greedy_divergence.py [--k 3] [--max-tokens 96] [--quantization none]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import speculative  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quantization", default="auto", help="auto keeps the GGUF blocks; none dequantizes")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    plain = LLM(quantization=args.quantization)
    speculating = LLM(quantization=args.quantization, speculative_config=spec)
    differ = []
    for index, message in enumerate(speculative.copy_heavy_messages()):
        prompt = {"prompt_token_ids": plain.chat_prompt([{"role": "user", "content": message}])["prompt_token_ids"]}
        a = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        b = speculating.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        if a != b:
            differ.append((index, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    print(f"prompts whose greedy output differs (index, first position): {differ}")


if __name__ == "__main__":
    main()
