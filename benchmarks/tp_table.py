"""Tensor parallelism on one host: `pagedllm bench` and `bench --latency` at TP=1 and TP=2, in one call, as a table.

    python benchmarks/tp_table.py --shapes tinyllama-1.1b llama3.2-1b --output-dir $OUT

Needs two GPUs. Every run has the host to itself, one after another (with --side-by-side the TP=1 runs of the two
shapes share it, one GPU each: faster, but in session 4 TinyLlama's TP=1 median was then 32,155 tok/s against
35,086-43,325 alone in earlier sessions, so host contention may lower TP=1). Every TP=2 throughput run also
profiles 20 full-batch decode steps, and the TP=2 latency runs one sequence's decode steps, for the time inside
NCCL's all-reduce kernels per step (rank 0's, waiting for the other rank included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def bench_command(shape: str, tp: int, latency: bool, output: Path) -> list[str]:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "--shape", shape]
    command += ["--tensor-parallel-size", str(tp), "--output", str(output)]
    if latency:
        command.append("--latency")
    if tp > 1:
        command.append("--profile")
    return command


def run_all(commands: list[tuple[list[str], dict[str, str]]], log_dir: Path) -> None:
    """Start the commands together and wait for all; each one's output goes to its own log."""
    running = []
    for command, env in commands:
        log = open(log_dir / (Path(command[command.index("--output") + 1]).stem + ".log"), "w")  # noqa: SIM115
        print("$", " ".join(command), env or "", flush=True)
        running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env), log))
    for process, log in running:
        process.wait()
        log.close()
        if process.returncode:
            print(f"exit {process.returncode}: see {log.name}", flush=True)


def read_pair(out: Path, stem: str) -> tuple[dict, dict] | None:
    """The TP=1 and TP=2 results of one run kind, or None (and a table row saying so) if either is missing."""
    paths = [out / f"{stem}_tp{tp}.json" for tp in (1, 2)]
    if not all(path.exists() for path in paths):
        print(f"| {stem} | missing run |")
        return None
    return tuple(json.loads(path.read_text()) for path in paths)


def print_table(shapes: list[str], out: Path) -> None:
    print("\n| shape | TP=1 output tok/s (first / median) | TP=2 (first / median) | TP=2 / TP=1 (median) |"
          " decode step at batch 256, TP=2 | of which all-reduce |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        if (pair := read_pair(out, shape)) is None:
            continue
        one, two = pair
        rates = [[run["tokens_per_s"] for run in result["runs"]] for result in (one, two)]
        medians = [result["median"]["tokens_per_s"] for result in (one, two)]
        profile = two.get("profile", {})
        print(
            f"| {shape} | {rates[0][0]:,.0f} / {medians[0]:,.0f} | {rates[1][0]:,.0f} / {medians[1]:,.0f} "
            f"| {medians[1] / medians[0]:.2f} | {profile.get('ms_per_step', float('nan')):.2f} ms "
            f"| {profile.get('all_reduce_ms_per_step', float('nan')):.2f} ms |"
        )
    print("\n| shape | one sequence 512/512, TP=1 | TP=2 | TP=2 / TP=1 | 32k context, TP=1 | TP=2 |"
          " all-reduce per one-sequence step, TP=2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        if (pair := read_pair(out, f"{shape}_latency")) is None:
            continue
        one, two = (result["latency"] for result in pair)
        short = [result["one_sequence_512_in_512_out_ms_per_token"] for result in (one, two)]
        long = [result.get("one_sequence_32k_context_ms_per_token", float("nan")) for result in (one, two)]
        all_reduce = two.get("profile", {}).get("all_reduce_ms_per_step", float("nan"))
        print(
            f"| {shape} | {short[0]:.2f} ms | {short[1]:.2f} ms | {short[1] / short[0]:.2f} | {long[0]:.2f} ms "
            f"| {long[1]:.2f} ms | {all_reduce:.3f} ms |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs=2, default=["tinyllama-1.1b", "llama3.2-1b"], help="two shapes")
    parser.add_argument("--output-dir", default="tp-results")
    parser.add_argument("--table-only", action="store_true", help="print the table of an earlier run")
    parser.add_argument("--side-by-side", action="store_true", help="the two TP=1 runs at once, one GPU each")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        # TP=1 on one GPU each: throughput, then latency
        for latency in (False, True):
            suffix = "_latency" if latency else ""
            one_gpu_each = [
                (bench_command(shape, 1, latency, out / f"{shape}{suffix}_tp1.json"), {"CUDA_VISIBLE_DEVICES": str(i)})
                for i, shape in enumerate(args.shapes)
            ]  # fmt: skip
            if args.side_by_side:
                run_all(one_gpu_each, out)
            else:
                for run in one_gpu_each:
                    run_all([run], out)
        # TP=2: one run at a time over both GPUs
        for latency in (False, True):
            suffix = "_latency" if latency else ""
            for shape in args.shapes:
                run_all([(bench_command(shape, 2, latency, out / f"{shape}{suffix}_tp2.json"), {})], out)
    print_table(args.shapes, out)


if __name__ == "__main__":
    main()
