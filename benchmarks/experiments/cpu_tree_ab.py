"""Two source trees of pagedllm on the default model, CPU, in one run: each (tree, workload) in its own process,
trees interleaved over rounds, the 1-minute load beside every run. For a change whose cost is in the engine's
steps (attention, sampler): model load is excluded, generate() alone is timed.

    python benchmarks/experiments/cpu_tree_ab.py --old /tmp/oldtree [--new .] [--rounds 2] [--workloads one chat16]
        [--threads 2] [--model DIR]

Workloads (greedy, EOS ignored): one = one chat prompt x 128 new tokens; chat16 = 16 chat prompts of ~40-1,000
tokens x 64 new (cpu_generate.py's prompts); prefill = one ~1,000-token prompt x 1 token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2] + "/benchmarks")
from cpu_generate import chat_prompts, nano_shape
from pagedllm import LLM, SamplingParams
workload = sys.argv[1]
threads = int(sys.argv[3]) or None  # 0: the engine's default
model = sys.argv[4] or None  # None: the default model
llm = LLM(model=model, enable_prefix_caching=False, threads=threads)  # the warm-up prompt is not served from the cache
prompts = chat_prompts(llm, 16)
if workload == "one":
    prompts, params = prompts[8:9], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
elif workload == "chat16":
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
elif workload == "nano64":
    prompts, lens = nano_shape(len(llm.get_tokenizer()))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
else:
    prompts, params = prompts[15:], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
requests = [{"prompt_token_ids": ids} for ids in prompts]
llm.generate(requests[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
start = time.perf_counter()
outputs = llm.generate(requests, params, use_tqdm=False)
seconds = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"tok_s": tokens / seconds, "seconds": seconds}))
"""


def run(tree: Path, workload: str, threads: int, model: str) -> dict:
    extensions = (
        Path("/tmp") / f"pagedllm_tree_ab_extensions_{hashlib.md5(str(tree.resolve()).encode()).hexdigest()[:8]}"
    )
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(extensions))
    load = os.getloadavg()[0]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, workload, str(tree), str(threads), model], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["one", "chat16"])
    parser.add_argument("--model", default="", help="a checkpoint (default: the default model)")
    parser.add_argument("--threads", type=int, default=0, help="LLM(threads=...); 0: the engine's default")
    args = parser.parse_args()
    results = {(tree, workload): [] for tree in ("old", "new") for workload in args.workloads}
    for round_index in range(args.rounds):
        for workload in args.workloads:
            order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
            for tree in order:
                result = run(getattr(args, tree), workload, args.threads, args.model)
                results[tree, workload].append(result)
                print(f"round {round_index} {workload} {tree}: {result['tok_s']:.3g} tok/s (load {result['load']:.2f})")
    print("\n| workload | old tok/s | new tok/s | new / old | runs (load) |\n|---|---|---|---|---|")
    for workload in args.workloads:
        old, new = (statistics.median(r["tok_s"] for r in results[t, workload]) for t in ("old", "new"))
        each = [(t, r) for t in ("old", "new") for r in results[t, workload]]
        runs = "; ".join(f"{t} {r['tok_s']:.3g} ({r['load']:.2f})" for t, r in each)
        print(f"| {workload} | {old:.3g} | {new:.3g} | {new / old:.3f} | {runs} |")


if __name__ == "__main__":
    main()
