"""`pagedllm bench`'s flags (argparse, the shapes and the engine's flags only, so `pagedllm --help` imports no torch;
the benchmark itself is pagedllm/entrypoints/bench.py)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.bench_common import SHAPES
from pagedllm.entrypoints.engine_args import add_engine_flags


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="model shape (qwen3-0.6b)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument(
        "--scale", type=positive_fraction,
        help="the workload scaled: scale x --num-seqs sequences, prompts and outputs scale x [100, 1024] tokens "
        "(default 1 on a GPU, 1/16 on a CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=positive_int, default=4,
        help="timed runs: the first, and the median of the others, are reported (4)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="print torch.profiler tables of decode steps, then of the workload's prefill steps, before the timed "
        "runs (with --latency: of one sequence's decode, last)",
    )  # fmt: skip
    parser.add_argument("--checkpoint-dir", default="/tmp/pagedllm-bench", help="where random checkpoints go")
    parser.add_argument("--output", help="write the result as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="draw the median run over time (needs matplotlib)")
    parser.add_argument(
        "--latency", action="store_true",
        help="instead of throughput: one sequence's ms per token (512 tokens in/out, and a 32,000-token context) "
        "and the time to first token of 8 fresh 128-token prompts",
    )  # fmt: skip
    add_engine_flags(parser, "bench")
    return parser
