"""Where a structured decode step's time goes at batch 256 (GPU): the host's mask fill (serial, and on llguidance's
executor with 2-16 threads), the matchers' token advance, and what a synchronous step costs without any mask.

    python benchmarks/experiments/structured_breakdown.py --shape qwen3-0.6b --tokenizer DIR [--batch 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import llguidance
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import structured_cost  # noqa: E402

import pagedllm.engine.plan_builder as plan_builder  # noqa: E402
import pagedllm.structured_output.llguidance_backend as llg_backend  # noqa: E402
from pagedllm import LLM  # noqa: E402
from pagedllm.engine.engine import LLMEngine  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)


def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - started

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="the engine's CPU threads (default: its own)")
    args = parser.parse_args()
    plan_builder.fill_rows = timed("fill", plan_builder.fill_rows)
    LLMEngine.advance_grammar = timed("advance", LLMEngine.advance_grammar)
    model = str(structured_cost.random_checkpoint_with_tokenizer(args.shape, args.tokenizer, torch.device("cuda")))
    for async_scheduling in (True, False):
        llm = LLM(model, max_model_len=1024, max_num_seqs=args.batch, async_scheduling=async_scheduling,
                  gpu_memory_utilization=0.5, threads=args.threads)  # fmt: skip
        structured_cost.decode_step_ms(llm, 4, 4, 8)  # warm
        variants = [("none", None, 0)] if not async_scheduling else [("none", None, 0), ("serial", None, args.batch)]
        if async_scheduling:
            variants += [(f"executor {n}", n, args.batch) for n in (2, 4, 8, 16)]
        for label, threads, constrained in variants:
            llg_backend.PARALLEL_FILL_MIN_ROWS = 10**9 if threads is None else 4
            if threads is not None:
                executor = llguidance.LLExecutor(num_threads=threads)
                llg_backend.parallel_executor = lambda executor=executor: executor
            best = None
            for _ in range(3):
                TIMES.clear()
                step = structured_cost.decode_step_ms(llm, args.batch, constrained, args.output_len)
                if best is None or step < best[0]:
                    best = (step, dict(TIMES))
            step, times = best
            per_step = {name: 1000 * value / args.output_len for name, value in times.items()}
            parts = "  ".join(f"{name} {value:5.2f} ms/step" for name, value in per_step.items())
            print(f"async {async_scheduling!s:5} {label:12} step {step:6.2f} ms  {parts}", flush=True)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
