"""End-to-end CPU decode of the default model (SmolLM2-135M Q4_1 GGUF) by weight format, each run in its own process,
interleaved over rounds: aten::mm on float weights (what ran before), oneDNN-reordered float weights, and the GGUF
blocks kept quantized. Workloads: one prompt x 128 new tokens, and cpu_generate.py's 32 chat prompts x 64 new.
Prints output tokens/s (model load excluded), the process's peak resident memory and the 1-minute load before each run.

    python benchmarks/cpu_weights.py [--threads 1] [--rounds 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = {  # name -> (quantization, extra environment)
    "aten::mm, float weights": (None, {"PAGEDLLM_ONEDNN_LINEAR": "0"}),
    "oneDNN, float weights": (None, {}),
    "GGUF blocks kept (default)": ("auto", {}),
}
WORKLOADS = {"one prompt x 128": (1, 128), "32 chat prompts x 64": (32, 64)}


def child(config: str, workload: str, threads: int, dtype: str) -> None:
    from cpu_generate import chat_prompts

    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", quantization=CONFIGS[config][0], threads=threads)
    count, new_tokens = WORKLOADS[workload]
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(llm, 32)]
    prompts = prompts[:count] if count > 1 else [prompts[5]]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tok_s": len(prompts) * new_tokens / elapsed, "peak_mb": peak_mb}))


def load() -> str:
    with open("/proc/loadavg") as file:
        return file.read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.threads, args.dtype)
        return
    results: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for config, (_, env) in CONFIGS.items():
                before = load()
                command = [sys.executable, __file__, "--child", config, workload]
                command += ["--threads", str(args.threads), "--dtype", args.dtype]
                path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
                environment = {**os.environ, **env, "PYTHONPATH": path}
                done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault((workload, config), []).append((measured["tok_s"], measured["peak_mb"], before))
                print(workload, "|", config, "|", measured, "| load", before, flush=True)
    print(f"\n{args.dtype}, {args.threads} thread(s), {args.rounds} rounds interleaved, medians")
    print("| workload | weights | output tok/s | each run (load before it) | peak RSS MB |\n|---|---|---|---|---|")
    for (workload, config), runs in results.items():
        each = ", ".join(f"{tok_s:.1f} ({before})" for tok_s, _, before in runs)
        median = statistics.median(tok_s for tok_s, _, _ in runs)
        peak = statistics.median(peak for _, peak, _ in runs)
        print(f"| {workload} | {config} | {median:.1f} | {each} | {peak:.0f} |")


if __name__ == "__main__":
    main()
