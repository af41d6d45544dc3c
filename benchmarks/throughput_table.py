"""Throughput and latency at one commit, in one call: `pagedllm bench` for each model shape (Qwen3-0.6B with a bf16
and an fp8 KV cache, TinyLlama-1.1B, Llama-3.2-1B), then `bench --latency`, one after another, each in its own
process with the host to itself; prints the results as one table.

    python benchmarks/throughput_table.py --output-dir $OUT [--timeout 150]

About 8-9 minutes on a fresh H200 machine (checkpoints written, Triton's cache cold); a run that outlives --timeout
seconds is stopped and its row says so, so the table still comes back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# (name of the result, bench arguments)
RUNS = [
    ("qwen3-0.6b", ["--shape", "qwen3-0.6b"]),
    ("qwen3-0.6b-fp8", ["--shape", "qwen3-0.6b", "--kv-cache-dtype", "fp8"]),
    ("tinyllama-1.1b", ["--shape", "tinyllama-1.1b"]),
    ("llama3.2-1b", ["--shape", "llama3.2-1b"]),
    ("latency", ["--shape", "qwen3-0.6b", "--latency"]),
]


def run_bench(name: str, arguments: list[str], out: Path, timeout: float) -> None:
    command = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "bench",
        *arguments,
        "--output",
        str(out / f"{name}.json"),
    ]
    print("$", " ".join(command), flush=True)
    (out / f"{name}.json").unlink(missing_ok=True)  # a failed run must not leave an earlier result in the table
    with open(out / f"{name}.log", "w") as log:
        try:
            process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped after {timeout:.0f} s", flush=True)
            return
    if process.returncode:
        print(f"{name}: exit {process.returncode}, see {name}.log", flush=True)
    # Each timed run's row on stdout too: a device call returns stdout whole, but only some of the files.
    for line in (out / f"{name}.log").read_text().splitlines():
        if line.startswith(("| run", "first run", "| one sequence", "| 8 fresh")):
            print(f"    {line}", flush=True)


def print_table(out: Path, names: list[str]) -> None:
    """The rows of the runs made in this invocation (names), from their JSON results."""
    print(
        "\n| shape | first run (output tok/s) | median of the later runs | first / median | % of roofline (median) "
        "| start-up (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        if name == "latency":
            continue
        path = out / f"{name}.json"
        if not path.exists():
            print(f"| {name} | no result |")
            continue
        result = json.loads(path.read_text())
        first, median = result["runs"][0]["tokens_per_s"], result["median"]["tokens_per_s"]
        roofline, load = result["percent_of_roofline"], result["load_s"]
        print(f"| {name} | **{first:,.0f}** | {median:,.0f} | {first / median:.0%} | {roofline:.0f}% | {load:.1f} |")
    path = out / "latency.json"
    if "latency" not in names:
        return
    if not path.exists():
        print("\nlatency: no result")
        return
    latency = json.loads(path.read_text())["latency"]
    print("\n| Qwen3-0.6B shape, `bench --latency` | |\n|---|---|")
    print(
        f"| one sequence, 512 in / 512 out | **{latency['one_sequence_512_in_512_out_ms_per_token']:.2f} ms/token** |"
    )
    print(
        f"| one sequence, 32,000-token context | **{latency['one_sequence_32k_context_ms_per_token']:.2f} ms/token** |"
    )
    ttft_ms = 1e3 * latency["eight_fresh_128_token_prompts_ttft_s"]
    print(f"| 8 fresh 128-token prompts, first token | **{ttft_ms:.0f} ms** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="JSON results and logs go here")
    parser.add_argument("--timeout", type=float, default=150, help="seconds one run may take (150)")
    parser.add_argument("--only", nargs="*", help="names of the runs to make (all)")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in RUNS if args.only is None or name in args.only]
    for name, arguments in RUNS:
        if name in names:
            run_bench(name, arguments, out, args.timeout)
    print_table(out, names)


if __name__ == "__main__":
    main()
