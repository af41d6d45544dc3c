"""What else uses the host while the engine's timed runs go? A sampler process reads /proc every 0.1 s (the machine's
CPU time by kind, steal and iowait included; dirty and writeback page-cache bytes; every process's CPU time) while
this process starts an engine and times nano-vllm's workload as `pagedllm bench` does. Per window (start-up, each
run) it prints: the engine process's CPU use, involuntary context switches and minor page faults, its busiest
threads besides the main one, the other processes' CPU use and the busiest of them by name, steal, iowait, and the
page cache still to be written. The sampler also times two fixed pieces of work of its own each interval, a Python
loop and random reads over 64 MiB: if they slow down with the engine, the whole machine is slower (clock, neighbours);
if they do not, the slowdown is the engine process's own (its memory, its heap). The engine's thread times the same
loop just before and after each run: slower there too, and its core is slower (clock, a neighbour on the core).

    python benchmarks/experiments/host_noise.py --shape tinyllama-1.1b [--runs 3] [--fresh-checkpoint] [--sync]

--fresh-checkpoint writes the random checkpoint again just before start-up (as a fresh machine's bench does);
--sync then flushes it to disk before start-up (is the kernel's writeback of it what slows a first run?).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

CPU_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
TICKS = os.sysconf("SC_CLK_TCK")


def machine_cpu() -> dict[str, int]:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1 : 1 + len(CPU_KINDS)]
    return dict(zip(CPU_KINDS, map(int, fields)))


def page_cache_mib() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, value = line.split(":")
            if name in ("Dirty", "Writeback", "AnonHugePages"):
                values[name.lower()] = int(value.split()[0]) // 1024
    return values


def cpu_ticks(folder: str) -> dict[int, tuple[str, int]]:
    """id -> (name, user + system ticks) of every process (folder /proc) or thread (/proc/PID/task) readable now."""
    ticks = {}
    for entry in os.scandir(folder):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{folder}/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:  # ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        ticks[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))
    return ticks


def involuntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def minor_faults(pid: int) -> int:
    """Page faults served without I/O: the first touch of fresh memory among them."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def python_loop_us(iterations: int = 20_000) -> float:
    """A fixed piece of interpreter work, ~1 ms: it takes longer only when this core runs slower."""
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return 1e6 * (time.perf_counter() - start)


def own_thread_loop_us(repeats: int = 20) -> float:
    """The fixed loop in the engine's own thread (median of repeats, ~20 ms), just before and after a run: if it is
    slower around a slow run, the engine's core runs slower; if not, the engine's own work (its memory) does."""
    return statistics.median(python_loop_us() for _ in range(repeats))


def random_reads_us(table, indices) -> float:
    """Reads at random places in a 64 MiB table: bound by memory latency and address translation."""
    start = time.perf_counter()
    table[indices].sum()
    return 1e6 * (time.perf_counter() - start)


def sample_forever(engine_pid: int, output: str, interval_s: float) -> None:
    """The sampler process: one JSON line per interval, until killed."""
    import numpy as np

    random = np.random.default_rng(0)
    table = random.integers(0, 1 << 30, size=(64 << 20) // 8)
    indices = random.integers(0, len(table), size=100_000)
    with open(output, "w") as out:
        while True:
            record = {"time": time.time(), "cpu": machine_cpu(), "processes": cpu_ticks("/proc")}
            record["python_loop_us"] = python_loop_us()
            record["random_reads_us"] = random_reads_us(table, indices)
            record["engine_threads"] = cpu_ticks(f"/proc/{engine_pid}/task")
            record |= page_cache_mib() | {"engine_switches": involuntary_switches(engine_pid)}
            record["engine_minor_faults"] = minor_faults(engine_pid)
            out.write(json.dumps(record) + "\n")
            out.flush()
            time.sleep(interval_s)


def summarize(samples: list[dict], start: float, end: float, engine_pid: int, sampler_pid: int) -> dict:
    inside = [s for s in samples if start <= s["time"] <= end]
    if len(inside) < 2:
        return {"samples": len(inside)}
    first, last = inside[0], inside[-1]
    seconds = last["time"] - first["time"]
    cpu = {kind: last["cpu"][kind] - first["cpu"][kind] for kind in CPU_KINDS}
    total = sum(cpu.values()) or 1
    others = Counter()
    for pid, (name, ticks) in last["processes"].items():
        before = first["processes"].get(pid, (name, 0))[1]
        if int(pid) not in (engine_pid, sampler_pid):
            others[name] += ticks - before
    engine = last["processes"].get(str(engine_pid), ("", 0))[1] - first["processes"].get(str(engine_pid), ("", 0))[1]
    # Threads of the engine's process besides the main one: each takes the GIL from the host loop while it runs Python.
    threads = Counter()
    for tid, (name, ticks) in last["engine_threads"].items():
        if int(tid) != engine_pid:
            threads[f"{name} {tid}"] += ticks - first["engine_threads"].get(tid, (name, 0))[1]
    return {
        "samples": len(inside),
        "engine_cpu_percent": 100 * engine / TICKS / seconds,
        "engine_involuntary_switches_per_s": (last["engine_switches"] - first["engine_switches"]) / seconds,
        "engine_minor_faults": last["engine_minor_faults"] - first["engine_minor_faults"],
        "busiest_engine_threads": [
            (name, round(100 * ticks / TICKS / seconds)) for name, ticks in threads.most_common(3)
        ],
        "others_cpu_percent": 100 * sum(others.values()) / TICKS / seconds,
        "busiest_others": [(name, round(100 * ticks / TICKS / seconds)) for name, ticks in others.most_common(3)],
        "steal_percent": 100 * cpu["steal"] / total,
        "iowait_percent": 100 * cpu["iowait"] / total,
        "max_dirty_mib": max(s.get("dirty", 0) for s in inside),
        "max_writeback_mib": max(s.get("writeback", 0) for s in inside),
        "anon_huge_pages_mib": inside[-1].get("anonhugepages", 0),
        # The sampler's own fixed work (median over the window): the machine's speed, apart from the engine's.
        "python_loop_us": statistics.median(s["python_loop_us"] for s in inside),
        "random_reads_us": statistics.median(s["random_reads_us"] for s in inside),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tinyllama-1.1b")
    parser.add_argument("--checkpoint", help="an existing checkpoint instead of the shape's random one (CPU checks)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--fresh-checkpoint", action="store_true")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--output", help="every window's summary as JSON")
    parser.add_argument("--sample", nargs=2, metavar=("PID", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample:
        sample_forever(int(args.sample[0]), args.sample[1], args.interval)
        return

    import torch

    from pagedllm import LLM
    from pagedllm.entrypoints.bench import timed_run
    from pagedllm.entrypoints.bench_common import nano_vllm_workload, write_random_checkpoint

    cuda = torch.cuda.is_available()
    checkpoint = Path(args.checkpoint or f"/tmp/pagedllm-bench/{args.shape}")
    if args.fresh_checkpoint and not args.checkpoint:
        shutil.rmtree(checkpoint, ignore_errors=True)
    if not (checkpoint / "config.json").exists():
        write_random_checkpoint(args.shape, checkpoint, torch.device("cuda" if cuda else "cpu"))
    if args.sync:
        os.sync()
    samples_file = f"/tmp/host_noise_{os.getpid()}.jsonl"
    sampler = subprocess.Popen([sys.executable, __file__, "--sample", str(os.getpid()), samples_file,
                                "--interval", str(args.interval)])  # fmt: skip
    prompts, output_lens = nano_vllm_workload(args.num_seqs)
    if not cuda:  # a CPU check of this script: a few short requests
        prompts, output_lens = [prompt[:32] for prompt in prompts[:4]], [4] * 4
    windows = []
    try:
        start = time.time()
        llm = LLM(str(checkpoint), max_model_len=4096, skip_tokenizer_init=True, enforce_eager=not cuda)
        windows.append(("start-up", start, time.time()))
        timed_run(llm, prompts[:8], [16] * len(prompts[:8]))  # warm-up, as bench
        for run in range(args.runs):
            own_loop_before = own_thread_loop_us()
            start = time.time()
            result = timed_run(llm, prompts, output_lens)
            name = (f"run {run} ({result.tokens_per_s:,.0f} tok/s, decode {result.decode_s:.2f} s; this thread's "
                    f"loop {own_loop_before:.0f} us before, {own_thread_loop_us():.0f} after)")  # fmt: skip
            windows.append((name, start, time.time()))
        llm.shutdown()
    finally:
        sampler.kill()
        sampler.wait()
    with open(samples_file) as lines:
        samples = [json.loads(line) for line in lines]
    os.remove(samples_file)
    summaries = {name: summarize(samples, start, end, os.getpid(), sampler.pid) for name, start, end in windows}
    for name, summary in summaries.items():
        print(name, json.dumps(summary), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
