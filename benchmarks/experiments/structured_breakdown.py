"""Where a structured decode step's time goes at batch 256 (GPU): the host's mask fill, the matchers' token advance,
and what a synchronous step costs without any mask. (At c024506 it also filled the rows on llguidance's executor at
2-16 threads, which the engine used then; that ran slower than one thread, and the engine fills rows serially since.)

    python benchmarks/experiments/structured_breakdown.py --shape qwen3-0.6b --tokenizer DIR [--batch 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import structured_cost  # noqa: E402
from timers import TIMES, timed  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.engine import step_pipeline  # noqa: E402
from pagedllm.engine.grammars import SampleGrammar  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="the engine's CPU threads (default: its own)")
    args = parser.parse_args()
    SampleGrammar.fill = timed("fill", SampleGrammar.fill)
    step_pipeline.advance_grammar = timed("advance", step_pipeline.advance_grammar)
    model = str(structured_cost.random_checkpoint_with_tokenizer(args.shape, args.tokenizer, torch.device("cuda")))
    for async_scheduling in (True, False):
        llm = LLM(model, max_model_len=1024, max_num_seqs=args.batch, async_scheduling=async_scheduling,
                  gpu_memory_utilization=0.5, threads=args.threads)  # fmt: skip
        structured_cost.decode_step_ms(llm, 4, 4, 8)  # warm
        variants = [("none", 0)] + ([("all rows", args.batch)] if async_scheduling else [])
        for label, constrained in variants:
            best = None
            for _ in range(3):
                TIMES.clear()
                step = structured_cost.decode_step_ms(llm, args.batch, constrained, args.output_len)
                if best is None or step < best[0]:
                    best = (step, {name: list(values) for name, values in TIMES.items()})
            step, times = best
            per_step = {name: 1000 * sum(values) / args.output_len for name, values in times.items()}
            parts = "  ".join(f"{name} {value:5.2f} ms/step" for name, value in per_step.items())
            print(f"async {async_scheduling!s:5} {label:12} step {step:6.2f} ms  {parts}", flush=True)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
