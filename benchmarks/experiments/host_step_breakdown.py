"""Where one GPU's host time per step goes, part by part, in nano-vllm's workload (one timed run after bench's
warm-up). `benchmarks/host_step_cost.py` measures the engine's side without a device; this one also times the
worker's side on the real device: padding the plan, the pinned uploads, the placeholders, the graph launch, the
logits, the sampler's launches and the copies back, and the wait for a step's tokens.

    python benchmarks/experiments/host_step_breakdown.py --checkpoint /tmp/pagedllm-bench/tinyllama-1.1b

With async scheduling the host prepares step N+1 while the device runs step N; the host sets the pace when its work
per step (everything below but the wait) is longer than the device's step. Each timer adds a call and two
clock reads to the part it times.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from timers import TIMES, timed

import pagedllm.engine.step_pipeline as step_pipeline
import pagedllm.executor.worker as worker_module
from pagedllm.engine.step_pipeline import StepPipeline
from pagedllm.executor.cuda_graphs import DecodeGraphs
from pagedllm.executor.step_inputs import StepBuffers
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.worker import Worker
from pagedllm.sampling.sampler import Sampler
from pagedllm.scheduler.scheduler import Scheduler

# (name, owner, attribute): each is wrapped in place before the engine is built. Nested ones (the worker's parts
# inside worker.execute) are also counted in their parent.
PARTS = [
    ("engine.step", None, None),  # wrapped on the engine instance below
    ("  schedule", Scheduler, "schedule"),
    ("  build the plan", step_pipeline, "build_step_plan"),
    ("  worker.execute", Worker, "execute"),
    ("    update sampler state", Worker, "update_sampler"),
    ("    pad the plan", worker_module, "pad_decode_plan"),
    ("    pinned uploads", StepBuffers, "upload"),
    ("    placeholders", Worker, "fill_placeholders"),
    ("    graph launch", DecodeGraphs, "replay"),
    ("    logits", None, None),  # wrapped on the model instance below
    ("    sampler", Sampler, "__call__"),
    ("    copies back (StepOutput)", StepOutput, "__init__"),
    ("  resolve", StepPipeline, "resolve"),
    ("    wait for the tokens", StepOutput, "token_ids"),
    ("  advance", Scheduler, "advance"),
    ("  append placeholders", Scheduler, "append_placeholders"),
]


def wrap_parts() -> None:
    for part_name, owner, attribute in PARTS:
        if owner is not None:
            setattr(owner, attribute, timed(part_name, getattr(owner, attribute)))


BUCKETS = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]


def print_device_idle(records) -> None:
    """Decode-only steps by batch size: the wall time between consecutive steps' tokens against the device's own
    time for the step (CUDA events around its work). Where the wall time is longer, the device waited for the host
    (or for the read-back): that gap is what host slack would win back."""
    print("| decode batch | steps | wall per step (ms, median) | device per step (ms, median) | "
          "device idle, total (ms) |")  # fmt: skip
    print("|---|---|---|---|---|")
    rows = []
    for previous, record in zip(records, records[1:]):
        if record.num_prefill_tokens == 0 and previous.num_prefill_tokens == 0 and record.events is not None:
            wall = record.resolved_at - previous.resolved_at
            device = record.events.start.elapsed_time(record.events.end) / 1e3
            rows.append((record.num_seqs, wall, device))
    for low, high in BUCKETS:
        inside = [(wall, device) for num_seqs, wall, device in rows if low <= num_seqs <= high]
        if inside:
            walls, devices = zip(*inside)
            idle = sum(max(0.0, wall - device) for wall, device in inside)
            print(f"| {low}-{high} | {len(inside)} | {1e3 * statistics.median(walls):.3f} | "
                  f"{1e3 * statistics.median(devices):.3f} | {1e3 * idle:.0f} |")  # fmt: skip


def main() -> None:
    import torch

    from pagedllm import LLM
    from pagedllm.entrypoints.bench import timed_run
    from pagedllm.entrypoints.bench_common import nano_vllm_workload

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="/tmp/pagedllm-bench/tinyllama-1.1b", help="written by pagedllm bench")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-parts", action="store_true", help="only the device-idle table (no per-part timers)")
    args = parser.parse_args()
    if not args.no_parts:
        wrap_parts()
    cuda = torch.cuda.is_available()
    llm = LLM(str(Path(args.checkpoint)), max_model_len=4096, skip_tokenizer_init=True, enforce_eager=not cuda)
    engine = llm.llm_engine
    engine.step = timed("engine.step", engine.step)
    if not args.no_parts:
        engine.worker.model.compute_logits = timed("    logits", engine.worker.model.compute_logits)
    prompts, output_lens = nano_vllm_workload(args.num_seqs)
    if not cuda:  # a CPU check of this script: a few short requests
        prompts, output_lens = [prompt[:32] for prompt in prompts[:4]], [4] * 4
    timed_run(llm, prompts[:8], [16] * len(prompts[:8]))  # warm-up, as bench
    records = []
    engine.add_step_listener(records.append, device_timings=True)
    for run in range(args.runs):
        TIMES.clear()
        records.clear()
        result = timed_run(llm, prompts, output_lens)
        steps = len(TIMES["engine.step"])
        print(f"run {run}: {result.tokens_per_s:,.0f} output tok/s, decode {result.decode_s:.2f} s, {steps} steps")
        print("| part | calls | total (ms) | per step (ms) | median per call (us) |")
        print("|---|---|---|---|---|")
        for part_name, _, _ in PARTS:
            times = TIMES.get(part_name, [])
            if times:
                print(f"| {part_name} | {len(times)} | {1e3 * sum(times):.0f} | {1e3 * sum(times) / steps:.3f} | "
                      f"{1e6 * statistics.median(times):.0f} |")  # fmt: skip
        print_device_idle(records)
    llm.shutdown()


if __name__ == "__main__":
    main()
