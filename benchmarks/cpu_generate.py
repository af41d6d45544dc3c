"""CPU throughput: pagedllm against transformers' batched generate on the embedded SmolLM2-135M, same run.

32 chat prompts of mixed length, 64 new tokens each (no early stop), float32, the same torch thread count.
Run: python benchmarks/cpu_generate.py [--threads N] [--num-prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.loader.default_model import default_model_path

TOPICS = ["the sea", "paged attention", "Paris", "prime numbers", "a robot", "coffee", "the moon", "Python"]
ASKS = ["Write one sentence about {}.", "Explain {} to a child.", "Summarise the notes above about {}."]
NOTE = "Note {}: the engine keeps the KV cache in blocks of sixteen tokens and reuses shared prefixes. "


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    """Chat prompts from a one-line question to a question after ~1,000 tokens of notes, lengths spread evenly."""
    rng = random.Random(0)
    prompts = []
    for index in range(count):
        notes = "".join(NOTE.format(n) for n in range(index * 48 // count))
        question = notes + rng.choice(ASKS).format(rng.choice(TOPICS))
        prompts.append(llm.chat_prompt([{"role": "user", "content": question}])["prompt_token_ids"])
    return prompts


def nano_shape(vocab: int, count: int = 64) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload at `count` sequences, seeded: prompts of U[100, 512] random token ids (from 100 on: no
    special tokens), outputs of U[50, 256] tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 512))] for _ in range(count)]
    return prompts, [rng.randint(50, 256) for _ in range(count)]


def time_pagedllm(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return elapsed


def time_transformers(prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    longest = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert output.shape[1] == longest + new_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype="float32", device="cpu")
    prompts = chat_prompts(llm, args.num_prompts)
    time_pagedllm(llm, prompts[:2], 4)  # warm-up
    ours = time_pagedllm(llm, prompts, args.new_tokens)
    theirs = time_transformers(prompts, args.new_tokens, llm.get_tokenizer().pad_token_id or 0)
    total = args.num_prompts * args.new_tokens
    lengths = sorted(map(len, prompts))
    print(
        f"\n{args.num_prompts} prompts ({lengths[0]}-{lengths[-1]} tokens), {args.new_tokens} new tokens each, "
        f"float32, {args.threads} thread(s)"
    )
    print("| engine | time (s) | output tokens/s |\n|---|---|---|")
    print(f"| pagedllm | {ours:.2f} | {total / ours:.0f} |")
    print(f"| transformers generate (batched, left padding) | {theirs:.2f} | {total / theirs:.0f} |")
    print(f"ratio: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
