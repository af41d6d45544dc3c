"""Speculative decoding on the embedded SmolLM2-135M-Instruct (CPU, or a GPU where one is): n-gram drafts against
none, in one run.

Workloads: 20 copy-heavy prompts, where the n-gram lookup can win (rewrite or correct a given text, edit a code
snippet, answer with quotes from a long context), and 20 free stories, where it cannot. Each prompt runs alone
(single-stream), with and without speculation one after the other (the order alternating), greedy; then all 40 at
once (batch 40, and the first 32: batch 32). The table gives, per workload and mode: decode tokens/s (tokens of
steps without prompt tokens over those steps' time), end-to-end tokens/s, tokens per decode step, drafts proposed,
acceptance rate, mean accepted length (tokens per verify step: accepted drafts + 1), and the machine's load average
(os.getloadavg, 1 minute) while it ran. Outputs with and without speculation are checked equal.

--cost measures what a verify step costs: one sequence at a ~400-token context, steps of 1 + m tokens (m drafts,
always rejected) against plain decode steps; c = (t(1 + m) / t(1) - 1) / m is the break-even acceptance rate
(spec_decode/backoff.py).

Run: python benchmarks/speculative.py [--max-tokens 128] [--k 4] [--cost]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import backoff
from pagedllm.trace.step_record import StepRecord

TEXTS = [
    "Teh old lighthouse stood on the edge of the cliff for more then a hundred years. Every night its keeper climbed "
    "the narow stairs, lit the great lamp, and wached the ships pass safely through the dark water below.",
    "Our team have finished the quarterly report. Sales was higher than expected in the north, but the south region "
    "seen a small drop. We recomend more training for new staff and a review of the delivery schedule.",
    "The recipe is simple: mix two cups of flour with one cup of milk, add three eggs and a pinch of salt, and stir "
    "untill smooth. Let the batter rest for ten minutes, then cook it in a hot pan with a little butter.",
    "When the train arrived at the station, the passengers hurryed onto the platform. A small boy held his mothers "
    "hand tightly while an old man with a blue umbrella searched for his ticket in every pocket.",
]
CODE = [
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price * item.count\n"
    "    return result\n\n\ndef average(items):\n    if not items:\n        return 0\n"
    "    return total(items) / len(items)\n",
    "class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def increment(self):\n"
    "        self.value = self.value + 1\n\n    def reset(self):\n        self.value = 0\n",
    "def read_lines(path):\n    handle = open(path)\n    lines = handle.readlines()\n    handle.close()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
]
CONTEXT = (
    "The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve dollars for "
    "adults and five dollars for children under twelve. The museum is closed on Mondays. Guided tours start every "
    "hour from the main hall and last about forty minutes. Photography is allowed in all galleries except the "
    "special exhibition on the second floor. The cafe on the ground floor serves coffee, sandwiches and cakes until "
    "five o'clock. Visitors with large bags must leave them in the lockers near the entrance. The gift shop sells "
    "books, posters and postcards of the most famous paintings in the collection."
)
QUESTIONS = [
    "When does the museum close?", "How much is a ticket for a child?", "On which day is the museum closed?",
    "How long does a guided tour last?", "Where is photography not allowed?", "What does the cafe serve?",
]  # fmt: skip
TOPICS = [
    "a dragon who is afraid of fire", "a lost cat in Paris", "a robot learning to paint", "two friends on a boat",
    "a village under the snow", "a clock that runs backwards", "a girl who talks to trees", "the last day of summer",
    "a detective and a missing hat", "a city on the moon", "a baker who never sleeps", "a storm at sea",
    "an old piano", "a garden on a roof", "a fox and a crow", "a train that goes nowhere", "a secret library",
    "the first snow", "a kite in the wind", "a letter from the future",
]  # fmt: skip


def copy_heavy_messages() -> list[str]:
    """Seven rewrites, seven code edits, six quotes from a long context."""
    rewrites = [f"Correct the spelling and grammar of this text and write it out in full:\n\n{text}" for text in TEXTS]
    rewrites += [f"Rewrite this text in the past tense, keeping every sentence:\n\n{text}" for text in TEXTS[:3]]
    edits = [f"Rename the variable `result` to `amount` and show the whole code:\n\n{CODE[0]}"]
    edits += [f"Add a docstring to every function and show the whole code:\n\n{code}" for code in CODE]
    edits += [f"Add type hints to this code and show all of it:\n\n{code}" for code in CODE]
    quotes = [f"{CONTEXT}\n\nAnswer with the exact sentence from the text above. {question}" for question in QUESTIONS]
    return rewrites + edits + quotes


def story_messages() -> list[str]:
    return [f"Write a short story about {topic}." for topic in TOPICS]


@dataclass
class Tally:
    """Step records of one workload and mode, summed."""

    seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    loads: list[float] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        elapsed = record.resolved_at - record.scheduled_at
        self.seconds += elapsed
        self.tokens += record.num_generated
        if record.num_prefill_tokens == 0:
            self.decode_seconds += elapsed
            self.decode_tokens += record.num_generated
            self.decode_steps += 1
        self.drafts += record.num_drafts
        self.draft_tokens += record.num_draft_tokens
        self.accepted += record.num_accepted_tokens

    def row(self, name: str, baseline: Tally | None) -> str:
        decode = self.decode_tokens / self.decode_seconds
        ratio = "" if baseline is None else f"{decode / (baseline.decode_tokens / baseline.decode_seconds):.2f}x"
        rate = f"{self.accepted / self.draft_tokens:.2f}" if self.draft_tokens else "-"
        mean_length = f"{(self.accepted + self.drafts) / self.drafts:.2f}" if self.drafts else "-"
        return (
            f"| {name} | {decode:.1f} | {ratio} | {self.tokens / self.seconds:.1f} | "
            f"{self.decode_tokens / self.decode_steps:.2f} | {self.draft_tokens} | {rate} | {mean_length} | "
            f"{statistics.mean(self.loads):.2f} |"
        )


def run(llm: LLM, prompts: list[dict], params: SamplingParams, tally: Tally) -> list[list[int]]:
    llm.llm_engine.add_step_listener(tally.add)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.remove_step_listener(tally.add)
    tally.loads.append(os.getloadavg()[0])
    return [output.outputs[0].token_ids for output in outputs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(
    plain: LLM, speculating: LLM, prompts: list[dict], params: SamplingParams, batch: bool, count_only: bool = False
) -> tuple:
    """Each prompt alone (or all at once with batch), plain and speculating one after the other, the order
    alternating; the outputs must be the same, or with count_only the differing ones are counted and printed."""
    tallies, differing = (Tally(), Tally()), []
    groups = [prompts] if batch else [[prompt] for prompt in prompts]
    for index, group in enumerate(groups):
        order = (0, 1) if index % 2 == 0 else (1, 0)
        results = {}
        for which in order:
            plain.reset_prefix_cache()
            speculating.reset_prefix_cache()
            results[which] = run((plain, speculating)[which], group, params, tallies[which])
        if count_only:
            differing += [d for a, b in zip(*results.values()) if (d := first_difference(a, b)) is not None]
        else:
            assert results[0] == results[1], "speculation changed a greedy output"
    if differing:
        print(f"outputs that speculation changed: {len(differing)} of {len(prompts)}, first differing tokens at "
              f"{sorted(differing)}")  # fmt: skip
    return tallies


def measure_cost(
    k: int, batch: int = 1, rounds: int = 8, quantization: str | None = "auto", threads: int | None = None
) -> None:
    """Step time of `batch` sequences of 1 + m tokens each against a plain decode step (drafts always rejected,
    back-off off): the median over 32 steps, each m once a round, interleaved; the fastest round's (the least
    disturbed)."""
    backoff.observe = lambda *args: None  # never pause: every step verifies m drafts
    engines = [LLM(quantization=quantization, threads=threads)] + [
        LLM(
            quantization=quantization,
            threads=threads,
            speculative_config={"method": "ngram", "num_speculative_tokens": m},
        )
        for m in range(1, k + 1)
    ]
    for llm in engines[1:]:
        llm.llm_engine.speculator.ngram.propose = lambda token_ids, num_tokens: [0] * num_tokens  # never sampled
    message = [{"role": "user", "content": CONTEXT * 3}]
    context = engines[0].chat_prompt(message)["prompt_token_ids"]
    contexts = [{"prompt_token_ids": [index] + context} for index in range(batch)]  # no prefix shared
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)

    def median_decode_step(llm: LLM) -> float:
        records = []
        llm.llm_engine.add_step_listener(records.append)
        llm.generate(contexts, params, use_tqdm=False)
        llm.llm_engine.remove_step_listener(records.append)
        return statistics.median(r.resolved_at - r.scheduled_at for r in records if r.num_prefill_tokens == 0)

    print(f"{batch} sequence(s) of {len(context) + 1} tokens, load {os.getloadavg()[0]:.2f}")
    best = [float("inf")] * len(engines)
    for _ in range(rounds):
        for m, llm in enumerate(engines):
            best[m] = min(best[m], median_decode_step(llm))
    print("| drafts m | step ms | vs decode | c = (ratio - 1) / m |\n| --- | --- | --- | --- |")
    for m, step in enumerate(best):
        c = f"{(step / best[0] - 1) / m:.3f}" if m else ""
        print(f"| {m} | {step * 1e3:.1f} | {step / best[0]:.2f} | {c} |")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", type=int, nargs=2, default=[2, 5], help="prompt_lookup_min, prompt_lookup_max")
    parser.add_argument("--cost", action="store_true", help="measure a verify step's cost instead")
    parser.add_argument("--batch", type=int, default=1, help="with --cost: sequences per step")
    parser.add_argument("--runs", nargs="+", default=["copy-heavy", "stories", "batch"],
                        help="which: copy-heavy and stories single-stream, batch (32 and 40)")  # fmt: skip
    parser.add_argument("--disable-by-batch-size", type=int, help="speculative_config's (default: its own)")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (float32 on a GPU keeps greedy exact)")
    parser.add_argument("--count-divergence", action="store_true",
                        help="count greedy outputs that speculation changed instead of stopping at the first: a GPU's "
                        "verify rows go through another kernel than decode rows, and near ties can flip")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=float, help="each engine's cache (two engines share one GPU)")
    parser.add_argument("--weights", choices=["gguf", "float"], default="gguf",
                        help="the GGUF blocks kept (the CPU default) or dequantized to the model's dtype")  # fmt: skip
    parser.add_argument("--threads", type=int, help="each engine's CPU threads (default: LLM's own)")
    args = parser.parse_args()
    quantization = "auto" if args.weights == "gguf" else None
    if args.cost:
        measure_cost(args.k, args.batch, quantization=quantization, threads=args.threads)
        return
    started = time.perf_counter()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1]}  # fmt: skip
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engine_args = dict(dtype=args.dtype, quantization=quantization, threads=args.threads)
    if args.kv_cache_gib:  # two engines in one process: the first must not take the GPU's whole free memory
        engine_args["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    plain, speculating = LLM(**engine_args), LLM(speculative_config=spec, **engine_args)
    chat = lambda message: {"prompt_token_ids": plain.chat_prompt([{"role": "user", "content": message}])[
        "prompt_token_ids"]}  # fmt: skip
    workloads = {"copy-heavy": [chat(m) for m in copy_heavy_messages()], "stories": [chat(m) for m in story_messages()]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    run(plain, workloads["stories"][:2], params, Tally())  # warm-up
    run(speculating, workloads["stories"][:2], params, Tally())
    print(f"speculative_config {spec}; {args.max_tokens} tokens at most, greedy; load {os.getloadavg()[0]:.2f}\n")
    header = ("| run | decode tok/s | vs plain | e2e tok/s | tokens/step | drafts | acceptance | mean accepted length "
              "| load |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    print(header)
    runs = [(f"{name}, single-stream", prompts, False) for name, prompts in workloads.items() if name in args.runs]
    mixed = [prompt for pair in zip(*workloads.values()) for prompt in pair]  # copy-heavy and stories in turn
    if "batch" in args.runs:
        runs += [("both, batch 32", mixed[:32], True), ("both, batch 40", mixed, True)]
    for name, prompts, batch in runs:
        tallies = compare(plain, speculating, prompts, params, batch, args.count_divergence)
        print(tallies[0].row(f"{name}, plain", None))
        print(tallies[1].row(f"{name}, n-gram", tallies[0]), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s; load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
