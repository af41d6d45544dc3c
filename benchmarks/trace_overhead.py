"""Tracing overhead: one workload with the tracer off and on, alternating in one process; medians compared.

GPU (H200): python benchmarks/trace_overhead.py --device cuda
    nano-vllm's workload on random qwen3-0.6b weights, exactly as `pagedllm bench` runs it (256 sequences).
CPU:        python benchmarks/trace_overhead.py --device cpu [--model DIR] [--threads 1]
    the default model (or DIR), --num-seqs requests of 16-256 random prompt tokens and 16-64 output tokens.
"Tracer on" is the full trace (host phases, device marks, counters, request tracks) kept in memory; the time to turn
it into JSON is reported on its own, since it happens once, when the trace is written. The host time spent inside the
tracer's own code is timed too: on a busy machine it is a steadier measure than the difference of two run times.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pagedllm import LLM
from pagedllm.entrypoints.bench import timed_run
from pagedllm.entrypoints.bench_common import nano_vllm_workload, write_random_checkpoint
from pagedllm.trace.tracer import Tracer

TRACER_HOOKS = ("describe_step", "on_step", "request_arrived", "request_finished")
tracer_seconds = [0.0]


def time_tracer_hooks() -> None:
    """Wrap the tracer's hooks (what the engine calls) so that their host time adds up in tracer_seconds."""
    for name in TRACER_HOOKS:
        hook = getattr(Tracer, name)

        def timed(*args, hook=hook):
            start = time.perf_counter()
            result = hook(*args)
            tracer_seconds[0] += time.perf_counter() - start
            return result

        setattr(Tracer, name, timed)


def cpu_workload(num_seqs: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab_size, 10000)) for _ in range(rng.randint(16, 256))] for _ in range(num_seqs)]
    return prompts, [rng.randint(16, 64) for _ in range(num_seqs)]


def build(args: argparse.Namespace) -> tuple[LLM, list[list[int]], list[int]]:
    if args.device == "cuda":
        checkpoint = Path(args.checkpoint_dir) / "qwen3-0.6b"
        if not (checkpoint / "model.safetensors").exists():
            write_random_checkpoint("qwen3-0.6b", checkpoint, torch.device("cuda"))
        llm = LLM(str(checkpoint), max_model_len=4096, skip_tokenizer_init=True)
        return llm, *nano_vllm_workload(args.num_seqs or 256)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", skip_tokenizer_init=True)
    return llm, *cpu_workload(args.num_seqs or 16, llm.llm_engine.spec.vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", help="CPU: a model directory (default: the embedded default model)")
    parser.add_argument("--num-seqs", type=int, help="requests per run (256 on cuda, 16 on cpu)")
    parser.add_argument("--repeats", type=int, default=3, help="runs with the tracer off and as many on (3)")
    parser.add_argument("--kv-every", type=int, help="also snapshot the KV block pool every N steps")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1)")
    parser.add_argument("--checkpoint-dir", default="/tmp/pagedllm-bench")
    args = parser.parse_args()
    llm, prompts, output_lens = build(args)
    time_tracer_hooks()
    engine = llm.llm_engine
    timed_run(llm, prompts, output_lens)  # warm-up at full size: on the GPU the first run is the slowest
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    serialize_s, trace_bytes, num_steps = [], 0, 0
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            tracer = engine.start_trace(None, args.kv_every) if mode == "on" else None
            run = timed_run(llm, prompts, output_lens)
            seconds[mode].append(run.total_s)
            if tracer is not None:
                start = time.perf_counter()
                trace = tracer.trace()
                trace_bytes = len(json.dumps(trace, separators=(",", ":")))
                num_steps += sum(1 for event in trace["traceEvents"] if event.get("cat") == "step")
                serialize_s.append(time.perf_counter() - start)
                engine.stop_trace()
    output_tokens = sum(output_lens)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"\n{len(prompts)} requests, {output_tokens} output tokens, on {device}")
    print("| tracer | runs (s) | median (s) | output tok/s |")
    print("|---|---|---|---|")
    for mode, times in seconds.items():
        median = statistics.median(times)
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {mode} | {runs} | {median:.3f} | {output_tokens / median:,.1f} |")
    overhead = statistics.median(seconds["on"]) / statistics.median(seconds["off"]) - 1
    print(f"tracing costs {100 * overhead:+.1f}% of run time; writing one run's trace as JSON ({trace_bytes:,} bytes) "
          f"takes {statistics.median(serialize_s):.3f} s more, once")  # fmt: skip
    inside, per_step_us = tracer_seconds[0], 1e6 * tracer_seconds[0] / num_steps
    print(f"inside the tracer: {inside:.3f} s over {num_steps} steps ({per_step_us:.0f} us per step) = "
          f"{100 * inside / sum(seconds['on']):.2f}% of the traced runs' time")  # fmt: skip


if __name__ == "__main__":
    main()
