"""Where a tensor-parallel step's host time goes, on every rank: run under torchrun so that the timers below are
installed in each rank's process.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experiments/tp_step_breakdown.py \
        --checkpoint /tmp/pagedllm-bench/tinyllama-1.1b

Rank 0: time inside send_plan (queueing the plan's broadcasts, after the previous plan's have completed),
inside Worker.execute (queueing the step), and the rest of engine.step (scheduling, sampling launch, waiting for
the step's tokens, outputs). Rank 1: time waiting in receive_plan and inside Worker.execute. Then nano-vllm's
workload once, timed as `pagedllm bench`.
torchrun sets OMP_NUM_THREADS=1 unless the environment sets it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
from pathlib import Path

import torch
from timers import TIMES, timed

import pagedllm.executor.ranks as ranks
from pagedllm.executor.plan_broadcast import PlanSender
from pagedllm.executor.worker import Worker


def report() -> None:
    """Mean and median per call: rank 1's calls include start-up (compilation, waiting for rank 0 to load), which
    the median leaves out."""
    rank = os.environ.get("RANK", "0")
    parts = [
        f"{name} mean {1e3 * statistics.fmean(times):.3f} / median {1e3 * statistics.median(times):.3f} ms"
        f" x {len(times)}"
        for name, times in TIMES.items()
    ]
    print(f"rank {rank}: " + ", ".join(parts), flush=True)


PlanSender.send = timed("send_plan", PlanSender.send)
ranks.receive_plan = timed("receive_plan", ranks.receive_plan)
Worker.execute = timed("worker.execute", Worker.execute)
atexit.register(report)


def main() -> None:
    from pagedllm import LLM
    from pagedllm.entrypoints.bench import timed_run
    from pagedllm.entrypoints.bench_common import nano_vllm_workload

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default="/tmp/pagedllm-bench/tinyllama-1.1b", help="written by pagedllm bench")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)
    llm = LLM(str(checkpoint), max_model_len=args.max_model_len, skip_tokenizer_init=True, tensor_parallel_size=2)
    engine = llm.llm_engine
    engine.step = timed("engine.step", engine.step)
    prompts, output_lens = nano_vllm_workload(args.num_seqs)
    timed_run(llm, prompts[:8], [16] * 8)
    TIMES.clear()
    run = timed_run(llm, prompts, output_lens)
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} torch threads {torch.get_num_threads()}: "
        f"{run.output_tokens / run.total_s:,.0f} output tok/s, prefill {run.prefill_s:.2f} s, "
        f"decode {run.decode_s:.2f} s",
        flush=True,
    )
    report()
    TIMES.clear()
    llm.shutdown()


if __name__ == "__main__":
    main()
