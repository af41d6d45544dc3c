"""What the n-gram proposer could do on speculative.py's prompts, without running a verify step: the default model's
greedy outputs of the copy-heavy prompts and the stories (float32, one plain run), then at each position of each
output what NgramProposer proposes and how many of its tokens the output takes (exact for greedy: speculation
changes no greedy token). Each proposer setting is priced with verify costs in decode steps (--cost, from
`speculative.py --cost`), as predicted tokens a step and speedup over plain decoding; an oracle that finds the
output's next k tokens anywhere in the context gives the ceiling of any lookup proposer.

    python benchmarks/experiments/ngram_replay.py [--max-tokens 96] [--cost 1.10 1.27 1.51 1.54 1.63 1.79]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative import copy_heavy_messages, story_messages  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.spec_decode.ngram import NgramProposer  # noqa: E402

SETTINGS = [(2, 5, 4), (1, 5, 4), (2, 8, 4), (3, 5, 4), (2, 5, 3), (2, 5, 6), (2, 5, 8)]  # (min, max, k)


def greedy_outputs(llm: LLM, messages: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    prompts = [llm.chat_prompt([{"role": "user", "content": message}]) for message in messages]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(prompt["prompt_token_ids"], list(out.outputs[0].token_ids)) for prompt, out in zip(prompts, outputs)]


def steps_of(runs, propose):
    """(drafts proposed, drafts accepted) of each step of a speculating greedy run over the given outputs."""
    for prompt, output in runs:
        i = 0
        while i < len(output):
            drafts = propose(prompt + output[:i], len(output) - i - 1)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[i + accepted]:
                accepted += 1
            i += accepted + 1
            yield len(drafts), accepted


def verify_price(drafts: int, cost: list[float]) -> float:
    """A step's price in decode steps: 1 without drafts; past the measured m, the last draft's price again."""
    if drafts == 0:
        return 1.0
    if drafts <= len(cost):
        return cost[drafts - 1]
    return cost[-1] + (drafts - len(cost)) * (cost[-1] - cost[-2])


def replay(runs, propose, cost: list[float]) -> tuple[float, float, float]:
    """tokens a step, predicted speedup (tokens over the steps' price in decode steps), share of steps with drafts."""
    steps = list(steps_of(runs, propose))
    tokens = sum(accepted + 1 for _, accepted in steps)
    price = sum(verify_price(proposed, cost) for proposed, _ in steps)
    return tokens / len(steps), tokens / price, sum(1 for proposed, _ in steps if proposed) / len(steps)


def oracle_steps(runs, k: int) -> int:
    """Steps if each took the longest prefix (up to k) of the output's continuation that occurs anywhere in the
    context (any length of match): the ceiling of a lookup proposer."""
    steps = 0
    for prompt, output in runs:
        i = 0
        while i < len(output):
            context, found = prompt + output[:i], 0
            for length in range(1, min(k, len(output) - i) + 1):
                pattern = output[i : i + length]
                if not any(context[j : j + length] == pattern for j in range(len(context) - length + 1)):
                    break
                found = length
            i += found + 1
            steps += 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cost", type=float, nargs="+", default=[1.10, 1.27, 1.51, 1.54, 1.63, 1.79],
                        help="a verify of m = 1, 2, ... drafts, in decode steps")  # fmt: skip
    args = parser.parse_args()
    llm = LLM(quantization=None)
    workloads = {"copy-heavy": copy_heavy_messages(), "stories": story_messages()}
    for name, messages in workloads.items():
        runs = greedy_outputs(llm, messages, args.max_tokens)
        print(f"{name}: {len(runs)} outputs, {sum(len(o) for _, o in runs)} tokens")
        print("| min, max, k | tokens/step | predicted speedup | steps that verify |\n| --- | --- | --- | --- |")
        for low, high, k in SETTINGS:
            proposer = NgramProposer(low, high)
            propose = lambda ctx, room, proposer=proposer, k=k: proposer.propose(ctx, min(k, room))  # noqa: E731
            per_step, speedup, share = replay(runs, propose, args.cost)
            print(f"| {low}, {high}, {k} | {per_step:.2f} | {speedup:.2f}x | {share:.2f} |")
        proposer = NgramProposer(2, 5)
        steps = sum(1 for _ in steps_of(runs, lambda ctx, room, proposer=proposer: proposer.propose(ctx, min(4, room))))
        print(
            f"steps: plain {sum(len(o) for _, o in runs)}, n-gram (2, 5, 4) {steps}, oracle (k = 4) "
            f"{oracle_steps(runs, 4)}\n"
        )


if __name__ == "__main__":
    main()
