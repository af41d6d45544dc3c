"""How often do chat answers loop? 20 chat prompts x 256 tokens on a model, under several sampling settings; and,
as a check that a setting does not spoil the answers, 10 questions of fact x 64 tokens (is the answer's word there).

An answer is caught in a loop when one 8-token sequence occurs in it 3 times or more (a sentence said over and
over). Sampled settings run every prompt with seeds 0..SEEDS-1; greedy runs each prompt once.
Run: python benchmarks/chat_loops.py [--model PATH] [--max-tokens 256] [--seeds 3] [--only TEXT]
"""

from __future__ import annotations

import argparse
import collections
import time

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Write a short story about a robot.",
    "Tell me about the history of Rome.",
    "Explain how a rainbow forms.",
    "What should I pack for a week of hiking?",
    "Describe your perfect weekend.",
    "Explain photosynthesis to a child.",
    "Write a poem about the sea.",
    "How do I make a good cup of coffee?",
    "What are the benefits of learning a second language?",
    "Give me some tips for a job interview.",
    "Why is the sky blue?",
    "Write a letter to a friend you have not seen in years.",
    "Explain what a computer program is.",
    "What is the difference between weather and climate?",
    "Describe a day in the life of a cat.",
    "How can I sleep better?",
    "Tell me about the planets of the solar system.",
    "What makes a good teacher?",
    "Write a recipe for pancakes.",
    "Explain how vaccines work.",
]
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many days are there in a week?", "seven"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What gas do plants take in from the air?", "carbon dioxide"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What is the freezing point of water in degrees Celsius?", "0"),
    ("Which ocean is the largest?", "Pacific"),
]
LOOP_NGRAM, LOOP_REPEATS = 8, 3

# name -> SamplingParams keywords (max_tokens and seed are added per run)
SETTINGS = {
    "greedy (chat's default before)": dict(temperature=0.0),
    "greedy, repetition_penalty 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "temperature 0.3, top_p 0.9, repetition_penalty 1.1": dict(temperature=0.3, top_p=0.9, repetition_penalty=1.1),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_p 0.9, repetition_penalty 1.1": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "temperature 0.6, top_p 0.95, top_k 20": dict(temperature=0.6, top_p=0.95, top_k=20),
    "temperature 0.2, top_p 0.9": dict(temperature=0.2, top_p=0.9),
    "temperature 0.2, top_p 0.9, repetition_penalty 1.1": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1),
}


def is_looping(token_ids: list[int], n: int = LOOP_NGRAM, repeats: int = LOOP_REPEATS) -> bool:
    """Some n-gram of the answer occurs `repeats` times or more."""
    counts = collections.Counter(tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1))
    return bool(counts) and max(counts.values()) >= repeats


def answers(llm: LLM, prompts: list[str], settings: dict, max_tokens: int, seeds: int) -> list:
    """Each prompt's answer, once per seed (once if greedy)."""
    num_seeds = 1 if settings.get("temperature", 1.0) == 0 else seeds
    conversations, params = [], []
    for seed in range(num_seeds):
        for prompt in prompts:
            conversations.append([{"role": "user", "content": prompt}])
            params.append(SamplingParams(max_tokens=max_tokens, seed=seed, **settings))
    return [output.outputs[0] for output in llm.chat(conversations, params, use_tqdm=False)]


def run_setting(llm: LLM, settings: dict, max_tokens: int, seeds: int) -> tuple[int, int, float, float, int, int]:
    """(answers looping, answers, mean answer length in tokens, share of answers that hit max_tokens, answers of
    fact with their word, answers of fact)."""
    chats = answers(llm, PROMPTS, settings, max_tokens, seeds)
    looping = sum(is_looping(list(answer.token_ids)) for answer in chats)
    mean_len = sum(len(answer.token_ids) for answer in chats) / len(chats)
    at_limit = sum(answer.finish_reason == "length" for answer in chats) / len(chats)
    facts = answers(llm, [question for question, _ in FACTS], settings, 64, seeds)
    words = [word for _, word in FACTS] * (len(facts) // len(FACTS))
    right = sum(word.lower() in answer.text.lower() for word, answer in zip(words, facts))
    return looping, len(chats), mean_len, at_limit, right, len(facts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", help="run only the settings whose name holds this text")
    args = parser.parse_args()
    llm = LLM(args.model)
    print(f"{len(PROMPTS)} chat prompts x {args.max_tokens} tokens; a loop: an {LOOP_NGRAM}-gram {LOOP_REPEATS}+ times")
    print("| settings | answers in a loop | mean length (tokens) | hit max_tokens | facts right | s |")
    print("|---|---|---|---|---|---|")
    for name, settings in SETTINGS.items():
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        looping, total, mean_len, at_limit, right, facts = run_setting(llm, settings, args.max_tokens, args.seeds)
        print(f"| {name} | {looping}/{total} ({100 * looping / total:.0f}%) | {mean_len:.0f} | "
              f"{100 * at_limit:.0f}% | {right}/{facts} | {time.perf_counter() - start:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
