"""Where a structured decode step's time goes at batch 256 (GPU): the host's mask fill, the matchers' token advance,
and what a synchronous step costs without any mask. (At c024506 it also filled the rows on llguidance's executor at
2-16 threads, which the engine used then; that ran slower than one thread on long-summary, and the engine fills rows
serially since.) --executor-threads N...: the all-rows step again with the rows filled at once on llguidance's
executor (LLExecutor) at each N, patched in here, for schemas whose rows share lexer states (free-notes).

    python benchmarks/experiments/structured_breakdown.py --shape qwen3-0.6b --tokenizer DIR [--batch 256]
        [--schema free-notes] [--executor-threads 4 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import structured_cost  # noqa: E402
from timers import TIMES, timed  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.engine import step_pipeline  # noqa: E402
from pagedllm.engine.grammars import SampleGrammar  # noqa: E402


def executor_fill(threads: int):
    """fill_masks with every live row filled at once on llguidance's executor (no scratch rows, no stop tokens)."""
    import llguidance

    executor = llguidance.LLExecutor(threads)

    def fill(owners, rows, verify_offsets=None):
        assert verify_offsets is None, "no speculation here"
        words = owners[rows[0]].grammar.num_words
        bitmask = np.full((len(rows), words), -1, dtype=np.int32)
        live = [(index, owners[row]) for index, row in enumerate(rows.tolist()) if not owners[row].is_finished]
        for _, seq in live:
            assert seq.grammar.scratch is None and not seq.grammar.stop_token_ids
        executor.unsafe_compute_mask_ptr(
            [(seq.grammar.matcher.matcher, index) for index, seq in live], bitmask.ctypes.data, words * 4, len(rows)
        )
        for index, seq in live:
            hidden = seq.grammar.matcher.hidden_end_token
            if hidden is not None:
                bitmask[index].view(np.uint32)[hidden // 32] &= ~np.uint32(1 << (hidden % 32))
        return bitmask

    return fill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="the engine's CPU threads (default: its own)")
    parser.add_argument("--schema", choices=structured_cost.SCHEMAS, default="long-summary")
    parser.add_argument("--executor-threads", type=int, nargs="*", default=[])
    args = parser.parse_args()
    schema = structured_cost.SCHEMAS[args.schema]
    SampleGrammar.fill = timed("fill", SampleGrammar.fill)
    step_pipeline.advance_grammar = timed("advance", step_pipeline.advance_grammar)
    serial_fill = step_pipeline.fill_masks = timed("fill rows", step_pipeline.fill_masks)
    step_pipeline.StepPipeline.fill_masks = timed("settle + fill", step_pipeline.StepPipeline.fill_masks)
    fills = {"all rows": serial_fill}
    fills |= {f"all, exec {n}": timed("fill rows", executor_fill(n)) for n in args.executor_threads}
    model = str(structured_cost.random_checkpoint_with_tokenizer(args.shape, args.tokenizer, torch.device("cuda")))
    for async_scheduling in (True, False):
        llm = LLM(model, max_model_len=1024, max_num_seqs=args.batch, async_scheduling=async_scheduling,
                  gpu_memory_utilization=0.5, threads=args.threads)  # fmt: skip
        structured_cost.decode_step_ms(llm, 4, 4, 8)  # warm
        variants = [("none", 0)] + ([(label, args.batch) for label in fills] if async_scheduling else [])
        for label, constrained in variants:
            step_pipeline.fill_masks = fills.get(label, serial_fill)
            best = None
            for _ in range(3):
                TIMES.clear()
                step = structured_cost.decode_step_ms(llm, args.batch, constrained, args.output_len, schema)
                if best is None or step < best[0]:
                    best = (step, {name: list(values) for name, values in TIMES.items()})
            step, times = best
            per_step = {name: 1000 * sum(values) / args.output_len for name, values in times.items()}
            parts = "  ".join(f"{name} {value:5.2f} ms/step" for name, value in per_step.items())
            print(f"async {async_scheduling!s:5} {label:13} step {step:6.2f} ms  {parts}", flush=True)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
