"""Why is the first run slower? Count the compilations (Triton kernel specialisations and torch.compile graphs) and
the caching allocator's cudaMalloc calls that each bench run triggers after start-up, and time the runs.
(CUDA_MODULE_LOADING=EAGER in the environment loads every kernel module at start-up: an A/B for lazy loading.)
It also times the garbage collector's pauses, and compares run 0's steps with run 1's.

Run on a GPU: python benchmarks/first_run_probe.py --shape qwen3-0.6b [--num-seqs 256]
(TORCH_LOGS=recompiles also prints each torch.compile recompilation's reason.)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import time
from collections import OrderedDict
from pathlib import Path

import torch
import triton

from pagedllm import LLM
from pagedllm.entrypoints.bench import timed_run
from pagedllm.entrypoints.bench_common import nano_vllm_workload, write_random_checkpoint
from pagedllm.entrypoints.bench_latency import random_prompt, time_to_first_token


def triton_kernels() -> dict[str, triton.runtime.jit.JITFunction]:
    import pagedllm.kernels.decode_attention as decode
    import pagedllm.kernels.kv_store as store
    import pagedllm.kernels.prefill_attention as prefill
    import pagedllm.kernels.race_sampling as race

    kernels = {}
    for module in (decode, store, prefill, race):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction):
                kernels[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = value
    return kernels


def specialisations(kernel) -> set:
    caches = getattr(kernel, "device_caches", {})
    return {key for cache in caches.values() for key in cache[0]}


GC_PAUSES: list[tuple[int, float]] = []  # (generation, seconds) of every garbage collection


def time_collections() -> None:
    started = {}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started["at"] = time.perf_counter()
        else:
            GC_PAUSES.append((info["generation"], time.perf_counter() - started["at"]))

    gc.callbacks.append(callback)


COMPILED: list[str] = []  # every Triton JIT compilation seen by the hook, in order


def record_compilation(*, repr: str, **_) -> None:  # noqa: A002 (Triton's keyword)
    COMPILED.append(repr)


def install_compile_hook() -> None:
    """Triton >= 3.3 calls knobs.runtime.jit_post_compile_hook after each JIT compilation (any kernel)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook"):
        knobs.runtime.jit_post_compile_hook = record_compilation


def snapshot() -> tuple[dict[str, set], int, int]:
    from torch._dynamo.utils import counters

    kernels = {name: specialisations(k) for name, k in triton_kernels().items()}
    # cudaMalloc calls of torch's caching allocator so far: a phase that needs memory the pool lacks makes new ones
    segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    return kernels, counters["stats"]["unique_graphs"], len(COMPILED), segments, len(GC_PAUSES), pinned_allocations()


def pinned_allocations() -> tuple[int, float]:
    """cudaHostAlloc calls of torch's pinned-memory allocator so far, and their total time in ms."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("num_host_alloc", 0), stats.get("host_alloc_time.total", 0) / 1e3


def report(label: str, before, after) -> None:
    kernels_before, graphs_before, compiled_before, segments_before, pauses_before, pinned_before = before
    kernels_after, graphs_after, compiled_after, segments_after, pauses_after, pinned_after = after
    full = [seconds for generation, seconds in GC_PAUSES[pauses_before:pauses_after] if generation == 2]
    young = [seconds for generation, seconds in GC_PAUSES[pauses_before:pauses_after] if generation < 2]
    new = {name: kernels_after[name] - kernels_before.get(name, set()) for name in kernels_after}
    total = sum(len(keys) for keys in new.values())
    print(
        f"{label}: {compiled_after - compiled_before} Triton JIT compilations (hook), {total} new cache entries in "
        f"pagedllm's kernels, {graphs_after - graphs_before} new torch.compile graphs, "
        f"{segments_after - segments_before} cudaMalloc calls by the caching allocator, "
        f"{pinned_after[0] - pinned_before[0]} cudaHostAlloc calls ({pinned_after[1] - pinned_before[1]:.1f} ms); "
        f"garbage collections: "
        f"{len(full)} full ({1e3 * sum(full):.0f} ms), {len(young)} young ({1e3 * sum(young):.0f} ms)"
    )
    for compiled in COMPILED[compiled_before:compiled_after]:
        print(f"    compiled {compiled[:300]}")
    for name, keys in new.items():
        for key in keys:
            print(f"    {name}: {str(key)[:300]}")


class StepClock:
    """Each step's size and host duration (from the previous step's tokens reaching the host to its own), so that run
    0's steps can be set against the same steps of a later run (the schedule is deterministic), and the host phases
    within it, for --steps-json (where the host waited for the device, and where it worked)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.previous = time.perf_counter()  # made just before its run starts

    def add(self, record) -> None:
        device_ms = record.events.forward_ms() + record.events.sampling_ms() if record.events else float("nan")
        self.steps.append(
            {
                "prefill_tokens": record.num_prefill_tokens,
                "seqs": record.num_seqs,
                "host_ms": 1e3 * (record.resolved_at - self.previous),
                "schedule_ms": 1e3 * (record.batched_at - record.scheduled_at),
                "plan_ms": 1e3 * (record.planned_at - record.batched_at),
                "launch_ms": 1e3 * (record.launched_at - record.planned_at),
                "wait_ms": 1e3 * (record.resolved_at - record.resolve_started_at),  # the host waiting for tokens
                "device_ms": device_ms,
            }
        )
        self.previous = record.resolved_at


def compare_steps(first: StepClock, later: StepClock, top: int = 12) -> None:
    """Where run 0 lost time: the steps it took longer than the later run, largest first."""
    pairs = list(zip(first.steps, later.steps))
    excess = [(a["host_ms"] - b["host_ms"], index, a, b) for index, (a, b) in enumerate(pairs)]
    prefill = sum(e for e, _, a, _ in excess if a["prefill_tokens"])
    decode = sum(e for e, _, a, _ in excess if not a["prefill_tokens"])
    device = [sum(s["device_ms"] for s in steps if s["prefill_tokens"]) for steps in (first.steps, later.steps)]
    print(
        f"run 0 vs run 1, {len(pairs)} steps: prefill steps {prefill:+.0f} ms, decode steps {decode:+.0f} ms; "
        f"device time of the prefill steps {device[0]:.0f} vs {device[1]:.0f} ms"
    )
    decode_excess = sorted(e for e, _, a, _ in excess if not a["prefill_tokens"])
    if decode_excess:
        quartiles = [decode_excess[int(q * (len(decode_excess) - 1))] for q in (0.1, 0.25, 0.5, 0.75, 0.9)]
        # Spread evenly (every step a little slower: the device) or a few large ones (one-time stalls)?
        print(
            "    decode steps' excess, ms (10/25/50/75/90th percentile): " + " / ".join(f"{q:+.3f}" for q in quartiles)
        )
    for _, index, a, b in sorted(excess, key=lambda item: item[:2], reverse=True)[:top]:
        print(
            f"    step {index}: {a['prefill_tokens']} prefill tokens, {a['seqs']} seqs: {a['host_ms']:.1f} ms vs "
            f"{b['host_ms']:.1f} ms (device {a['device_ms']:.1f} vs {b['device_ms']:.1f} ms)"
        )


def compare_profiles(first: dict, second: dict, top: int = 25) -> None:
    """The functions whose own time (tottime) grew most from run 1 to run 0, then their cumulative time."""

    def label(key):
        filename, line, name = key
        return f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})"

    rows = []
    for key, (calls, _, tottime, cumtime, _) in first.items():
        other = second.get(key, (0, 0, 0.0, 0.0, {}))
        rows.append((tottime - other[2], cumtime - other[3], calls, other[0], key))
    print("cProfile, run 0 minus run 1: own time (ms), cumulative (ms), calls run 0 / run 1, function")
    for own, cumulative, calls, other_calls, key in sorted(rows, key=lambda row: row[0], reverse=True)[:top]:
        print(f"    {1e3 * own:+8.1f} {1e3 * cumulative:+8.1f} {calls:>8} / {other_calls:<8} {label(key)}")
    print("cProfile, run 0 minus run 1, largest cumulative:")
    for own, cumulative, calls, other_calls, key in sorted(rows, key=lambda row: row[1], reverse=True)[:top]:
        print(f"    {1e3 * own:+8.1f} {1e3 * cumulative:+8.1f} {calls:>8} / {other_calls:<8} {label(key)}")


PREFILL_PHASES = ("launch_ms", "device_ms", "plan_ms", "schedule_ms")


def summarise_prefill(clocks: list[StepClock]) -> None:
    """Per run, the prefill steps' host phases against their device time. When the launch takes as long as the
    device (prompt steps launched op by op, without prefill graphs), the device waits for the host, and the host's
    own phases (plan, schedule), which wait for nothing, show whether the host itself was slower."""
    print("prefill steps per run, sums (ms): launch (worker.execute) / device (CUDA events) / plan / schedule")
    for index, clock in enumerate(clocks):
        steps = [step for step in clock.steps if step["prefill_tokens"]]
        launch, device, plan, schedule = (sum(step[key] for step in steps) for key in PREFILL_PHASES)
        print(f"    run {index}: {len(steps)} steps: {launch:.0f} / {device:.0f} / {plan:.1f} / {schedule:.1f}")


def reorder_free_blocks(block_manager, order: str) -> None:
    """Hand out the free blocks in another order (no block is held between runs, so all are free)."""
    block_ids = list(block_manager.free_block_ids)
    if order == "rotated":
        block_ids = block_ids[len(block_ids) // 2 :] + block_ids[: len(block_ids) // 2]
    elif order == "shuffled":
        random.Random(0).shuffle(block_ids)
    block_manager.free_block_ids = OrderedDict.fromkeys(block_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default="/tmp/pagedllm-bench")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--steps-json", help="write every run's steps (host phases, device time) to this file")
    parser.add_argument(
        "--free-list",
        choices=["as-is", "rotated", "shuffled"],
        default="as-is",
        help="order of the free KV blocks before run 0: as start-up left it (block 0 first), starting half-way "
        "through the cache, or in random order (where run 0's blocks lie in memory)",
    )
    parser.add_argument("--cprofile", action="store_true", help="cProfile each run; print what run 0 spent more on")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (A/B)")
    parser.add_argument(
        "--host-only", action="store_true", help="time steps on the host clock alone, as bench does (no CUDA events)"
    )
    args = parser.parse_args()
    install_compile_hook()
    time_collections()
    checkpoint = Path(args.checkpoint_dir) / args.shape
    if not (checkpoint / "model.safetensors").exists():
        write_random_checkpoint(args.shape, checkpoint, torch.device("cuda"))
    prompts, output_lens = nano_vllm_workload(args.num_seqs)
    start = time.perf_counter()
    before = snapshot()
    llm = LLM(str(checkpoint), max_model_len=4096, skip_tokenizer_init=True, kv_cache_dtype=args.kv_cache_dtype)
    print(f"start-up {time.perf_counter() - start:.1f} s")
    report("start-up", before, before := snapshot())
    timed_run(llm, prompts[:8], [16] * 8)
    report("bench warm-up (8 prompts x 16 tokens)", before, before := snapshot())
    reorder_free_blocks(llm.llm_engine.block_manager, args.free_list)
    if args.gc_freeze:
        gc.freeze()
    clocks, profiles = [], []
    for index in range(args.runs):
        clocks.append(StepClock())
        llm.llm_engine.add_step_listener(clocks[-1].add, device_timings=not args.host_only)
        first_pause = len(GC_PAUSES)
        profiler = cProfile.Profile() if args.cprofile else None
        if profiler is not None:
            profiler.enable()
        result = timed_run(llm, prompts, output_lens)
        if profiler is not None:
            profiler.disable()
            profiles.append(pstats.Stats(profiler).stats)
        long_pauses = [f"gen {gen} {1e3 * s:.1f} ms" for gen, s in GC_PAUSES[first_pause:] if s > 2e-3]
        print(f"run {index}: collections over 2 ms: {', '.join(long_pauses) or 'none'}")
        llm.llm_engine.remove_step_listener(clocks[-1].add)
        print(
            f"run {index}: {result.tokens_per_s:,.0f} tok/s (prefill {result.prefill_s:.2f} s, "
            f"decode {result.decode_s:.2f} s)"
        )
        report(f"run {index}", before, before := snapshot())
    if len(clocks) > 1:
        compare_steps(clocks[0], clocks[1])
    if len(profiles) > 1:
        compare_profiles(profiles[0], profiles[1])
    summarise_prefill(clocks)
    if args.steps_json:
        Path(args.steps_json).write_text(json.dumps([clock.steps for clock in clocks]))
    # Fresh shapes after the runs, as a server sees them: batches of new prompts of sizes the runs never had.
    rng = random.Random(1)
    for num_prompts, length in ((1, 77), (8, 128), (16, 128), (13, 300)):
        ttft = time_to_first_token(llm, [random_prompt(rng, length) for _ in range(num_prompts)])
        report(f"{num_prompts} fresh {length}-token prompts: first token after {1e3 * ttft:.0f} ms", before,
               before := snapshot())  # fmt: skip


if __name__ == "__main__":
    main()
