"""Greedy outputs on a CUDA GPU: with n-gram speculation against without, and batched against alone, in bfloat16
and float32, on a small random Llama (save_pretrained here). Copy-heavy prompts (a random segment repeated) so that
drafts are proposed. Prints, per dtype, how many of the prompts' outputs differ and where the first difference is.

The CPU torch backend makes decode and verify rows bit-identical (attention/torch_backend.py); this asks how far the
GPU path (split-K decode kernel whose split count follows the batch, verify rows through the prefill kernel, CUDA
graphs) is from that.

    python benchmarks/experiments/gpu_spec_divergence.py [--prompts 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def random_llama(directory: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2048) for _ in range(rng.randrange(8, 40))] * 3}
               for _ in range(args.prompts)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as directory:
        random_llama(directory)
        for dtype in ("bfloat16", "float32"):
            engine = dict(skip_tokenizer_init=True, dtype=dtype, num_kv_blocks=4096, max_num_seqs=64)
            plain = LLM(directory, **engine)
            alone = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            batched = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
            plain.shutdown()
            speculating = LLM(directory, speculative_config=NGRAM, **engine)
            spec_alone = [speculating.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            speculating.shutdown()
            for name, outputs in (("batched", batched), ("speculating alone", spec_alone)):
                diffs = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(alone, outputs)) if a != b]
                print(f"{dtype}: {name} against plain alone: {len(diffs)} of {len(prompts)} differ {diffs[:8]}")


if __name__ == "__main__":
    main()
