"""A/B of structured decode steps at one batch size on a GPU: whichever pagedllm is first on PYTHONPATH (put an older
tree's package first to compare). Per full-batch decode step (medians, the best of --rounds rounds): the period
(resolved_at deltas), the host's phases (StepRecord), and the device's forward and forward_done -> end (logits, the
wait for the masks, sampling) from CUDA events.

    PYTHONPATH=OLD_TREE python benchmarks/experiments/structured_ab.py --tokenizer DIR [--shape llama3.1-8b]
        [--checkpoint DIR] [--batch 256] [--schema free-notes]
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

import pagedllm
from pagedllm import LLM
from pagedllm.entrypoints.bench_common import write_random_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_cost import SCHEMAS, recorded_generate, row_params  # noqa: E402


def run(llm, batch, constrained, output_len, schema):
    _, records = recorded_generate(llm, row_params(batch, constrained, output_len, schema), device_timings=True)
    rows = []
    for earlier, later in zip(records, records[1:]):
        if later.num_decode_tokens == batch and later.num_prefill_tokens == 0:
            ev = later.events
            rows.append(
                {
                    "period": later.resolved_at - earlier.resolved_at,
                    "schedule": later.batched_at - later.scheduled_at,
                    "plan": later.planned_at - later.batched_at,
                    "launch": later.launched_at - later.planned_at,
                    "resolve": later.resolved_at - later.resolve_started_at,
                    "dev fwd": ev.forward_ms() / 1e3,
                    "dev fwd->end": ev.sampling_ms() / 1e3,
                }
            )
    return {key: 1e3 * statistics.median(r[key] for r in rows) for key in rows[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--schema", default="free-notes")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default=os.path.dirname(pagedllm.__file__))
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--checkpoint", default=None, help="written here once, reused by later runs")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    directory = Path(args.checkpoint or tempfile.mkdtemp())
    if not (directory / "config.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        write_random_checkpoint(args.shape, directory, torch.device("cuda"), vocab_size=len(tokenizer))
        tokenizer.save_pretrained(directory)
    llm = LLM(str(directory), max_model_len=1024, max_num_seqs=args.batch)
    schema = SCHEMAS[args.schema]
    run(llm, 4, 4, 8, schema)
    best = {}
    for _ in range(args.rounds):
        for constrained in (0, args.batch):
            result = run(llm, args.batch, constrained, args.output_len, schema)
            if constrained not in best or result["period"] < best[constrained]["period"]:
                best[constrained] = result
    print(f"{args.label} {args.shape} schema {args.schema} batch {args.batch} load {os.getloadavg()[0]:.2f}")
    for constrained, result in best.items():
        print(f"  constrained {constrained:3}: " + "  ".join(f"{k} {v:5.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
