"""`pagedllm bench`: offline throughput on nano-vllm's workload, against the roofline of the same workload.

Workload (nano-vllm's bench.py): random.seed(0); 256 sequences; prompt lengths uniform in [100, 1024] of random
token ids in [0, 10000); output lengths uniform in [100, 1024]; temperature 0.6; ignore_eos; max_model_len 4096.
On a CPU the same workload scaled (--scale, CPU_SCALE by default): scale x the sequences and the lengths.
The model is a real checkpoint of random bf16 weights with a published model's shape, written to disk and
loaded through the normal loader. Roofline: FLOPs over the measured matmul rate (bf16 on a GPU, the engine's dtype
on a CPU), and the bytes a decode step must read (weights once, plus every sequence's KV) over the measured memory
bandwidth (a GPU's copy, a CPU's read), measured on the engine's own device and threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm.entrypoints.bench_common import (
    SHAPES,
    device_time_per_step,
    measure_ceilings,
    measure_cpu_ceilings,
    scaled_workload,
    write_random_checkpoint,
)
from pagedllm.entrypoints.engine_args import engine_kwargs

CPU_SCALE = 1 / 16  # 16 sequences, prompts and outputs of 6-64 tokens: a run of seconds on a laptop's CPU


@dataclass
class Roofline:
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def roofline(
    shape: str,
    prompts: list[list[int]],
    output_lens: list[int],
    flops: float,
    bandwidth: float,
    kv_cache_dtype: str,
    weight_flops: float | None = None,
    value_bytes: int = 2,
    weight_bytes_per_param: int | None = None,
) -> Roofline:
    """Lower bound for the workload: prefill is compute-bound, decode reads weights once per step (all sequences
    decode together, so steps = the longest output) plus each sequence's whole KV at every token. value_bytes: the
    size of a weight (and of a KV value without fp8): 2 for bf16, 4 for float32. The layers' linear weights take
    weight_bytes_per_param bytes (default value_bytes) and multiply at weight_flops (fp8 weights: 1 byte, fp8's
    rate; their scales are not counted); the embedding, the lm head and attention run at `flops`."""
    s = SHAPES[shape]
    head_dim = s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]
    q_size, kv_size = s["num_attention_heads"] * head_dim, s["num_key_value_heads"] * head_dim
    layer_params = s["hidden_size"] * (2 * q_size + 2 * kv_size) + 3 * s["hidden_size"] * s["intermediate_size"]
    body_params, head_params = s["num_hidden_layers"] * layer_params, s["vocab_size"] * s["hidden_size"]
    attention_flops_per_pair = 4 * s["num_hidden_layers"] * q_size  # QK^T and PV, per (query, key) pair
    # K and V in the model's dtype, or fp8 plus a float32 scale per head
    kv_bytes_per_head = head_dim + 4 if kv_cache_dtype == "fp8" else value_bytes * head_dim
    kv_bytes_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * kv_bytes_per_head

    weight_flops = weight_flops or flops

    def compute_s(body_flops: float, other_flops: float) -> float:
        return body_flops / weight_flops + other_flops / flops

    prompt_lens = [len(p) for p in prompts]
    prefill_s = compute_s(
        2 * body_params * sum(prompt_lens),
        2 * head_params * len(prompts) + attention_flops_per_pair * sum(n * (n + 1) / 2 for n in prompt_lens),
    )
    decode_contexts = [p + i for p, out in zip(prompt_lens, output_lens) for i in range(1, out)]
    decode_compute_s = compute_s(
        2 * body_params * len(decode_contexts),
        2 * head_params * len(decode_contexts) + attention_flops_per_pair * sum(decode_contexts),
    )
    weight_bytes = (weight_bytes_per_param or value_bytes) * body_params + value_bytes * head_params
    decode_bytes = (max(output_lens) - 1) * weight_bytes + kv_bytes_per_token * sum(decode_contexts)
    return Roofline(prefill_s, max(decode_compute_s, decode_bytes / bandwidth))


@dataclass
class RunResult:
    total_s: float
    prefill_s: float
    decode_s: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s


class PhaseTimer:
    """Sums step durations from the engine's step records: a step lasts from the previous step's tokens reaching
    the host to its own; a step with any prompt tokens counts as prefill time."""

    def __init__(self, start: float):
        self.previous_resolved_at = start
        self.prefill_s = self.decode_s = 0.0

    def add(self, record) -> None:
        elapsed = record.resolved_at - self.previous_resolved_at
        self.previous_resolved_at = record.resolved_at
        if record.num_prefill_tokens:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed


def add_workload(llm, name: str, prompts: list[list[int]], output_lens: list[int]) -> None:
    """Queue the prompts as the workload samples them (temperature 0.6, exactly output_lens[i] tokens each), on an
    empty prefix cache so that no run reuses an earlier run's blocks."""
    from pagedllm import SamplingParams

    llm.reset_prefix_cache()
    for index, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
        llm.llm_engine.add_request(f"{name}-{index}", {"prompt_token_ids": prompt}, params, stream=False)


def timed_run(llm, prompts: list[list[int]], output_lens: list[int]) -> RunResult:
    engine = llm.llm_engine
    add_workload(llm, "bench", prompts, output_lens)
    output_tokens = 0
    start = time.perf_counter()
    timer = PhaseTimer(start)
    engine.add_step_listener(timer.add)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        output_tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
    total_s = time.perf_counter() - start
    engine.remove_step_listener(timer.add)
    assert output_tokens == sum(output_lens)
    return RunResult(total_s, timer.prefill_s, timer.decode_s, output_tokens)


def profile_decode(llm, prompts: list[list[int]], num_steps: int = 20) -> dict:
    """Print where a full-batch decode step spends GPU and host time (torch.profiler), for tuning; return the
    step time and the kernel and all-reduce time per step (rank 0's)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    add_workload(llm, "profile", prompts, [4 * num_steps] * len(prompts))
    while engine.scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(num_steps):
            engine.step()
    elapsed = (time.perf_counter() - start) / num_steps
    result = {"batch": len(engine.scheduler.running), "ms_per_step": elapsed * 1e3}
    result |= device_time_per_step(profiler, num_steps)
    print(f"\nprofiled decode steps: {elapsed * 1e3:.2f} ms/step (batch {result['batch']}), kernels "
          f"{result['kernel_ms_per_step']:.3f} ms/step, of which all-reduce {result['all_reduce_ms_per_step']:.3f} ms "
          f"({result['all_reduces_per_step']:.0f} collectives)")  # fmt: skip
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    while engine.has_unfinished_requests():
        engine.step()
    return result


def profile_prefill(llm, prompts: list[list[int]]) -> dict:
    """Print where the workload's prefill steps spend GPU and host time (torch.profiler): every prompt once, one
    output token each, so the profiled steps are the prefill steps alone; return their number and kernel time.
    When the kernels' sum is well below the steps' time, the host sets the pace, and the second table says where its
    time goes (prompt steps replay CUDA graphs unless enforce_eager; launched op by op, they were host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    add_workload(llm, "profile-prefill", prompts, [1] * len(prompts))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    num_steps, start = 0, time.perf_counter()
    with profile(activities=activities) as profiler:
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
    elapsed = time.perf_counter() - start
    result = {"steps": num_steps, "prompt_tokens": sum(map(len, prompts)), "s": elapsed}
    result |= device_time_per_step(profiler, num_steps)
    kernel_ms = result["kernel_ms_per_step"] * num_steps
    print(f"\nprofiled prefill: {num_steps} steps, {result['prompt_tokens']:,} prompt tokens, {elapsed:.3f} s under "
          f"the profiler, kernels {kernel_ms:.1f} ms in all")  # fmt: skip
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    return result


def run_benchmark(args: argparse.Namespace, device: torch.device) -> dict:
    from pagedllm import LLM

    checkpoint = Path(args.checkpoint_dir) / args.shape
    if not (checkpoint / "model.safetensors").exists():
        write_random_checkpoint(args.shape, checkpoint, device)
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else CPU_SCALE)
    prompts, output_lens = scaled_workload(args.num_seqs, scale)
    start = time.perf_counter()
    llm = LLM(str(checkpoint), max_model_len=4096, skip_tokenizer_init=True, **engine_kwargs(args, "bench"))
    load_s = time.perf_counter() - start
    tracer = llm.llm_engine.tracer
    if args.plot and tracer is None:
        tracer = llm.llm_engine.start_trace(None)  # in memory, for the plot
    timed_run(llm, prompts[:8], [16] * 8)  # warm-up: kernels compiled, allocator primed
    profile = profile_decode(llm, prompts) if args.profile else None
    prefill_profile = profile_prefill(llm, prompts) if args.profile else None
    runs, windows = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        runs.append(timed_run(llm, prompts, output_lens))
        windows.append((start, time.perf_counter()))
    # The first run is what a user's first generate() gets; the median is taken over the runs after it.
    later = runs[1:] or runs
    median = sorted(later, key=lambda run: run.total_s)[len(later) // 2]
    dtype = llm.llm_engine.resolved.dtype
    fp8_weights = args.quantization == "fp8"
    # A CPU's ceilings with the threads the engine runs (it set torch's); a GPU's in bf16 (and fp8 for fp8 weights)
    if device.type == "cuda":
        flops, weight_flops, bandwidth = measure_ceilings(device, fp8=fp8_weights)
    else:
        flops, bandwidth = measure_cpu_ceilings(dtype)
        weight_flops = flops
    # Tensor parallelism: the ranks' GPUs together (one measured, the rest assumed equal; all-reduces not counted);
    # CPU ranks share one machine's cores and memory
    devices = args.tensor_parallel_size if device.type == "cuda" else 1
    bound = roofline(args.shape, prompts, output_lens, flops * devices, bandwidth * devices, args.kv_cache_dtype,
                     weight_flops * devices, dtype.itemsize, 1 if fp8_weights else None)  # fmt: skip
    if tracer is not None:
        save_trace_and_plot(llm, args, windows[runs.index(median)], median.output_tokens / bound.total_s)
    num_kv_blocks = llm.llm_engine.worker.num_kv_blocks
    llm.shutdown()  # ends the other ranks, so the next benchmark in this process can start its own
    result = {
        "shape": args.shape,
        ("gpu" if device.type == "cuda" else "cpu"): device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "workload": {
            "scale": scale,
            "sequences": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(output_lens),
        },  # fmt: skip
        "traced": tracer is not None,
        "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": args.tensor_parallel_size,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_kv_blocks": num_kv_blocks,
        "load_s": load_s,
        "runs": [asdict(run) | {"tokens_per_s": run.tokens_per_s} for run in runs],
        "median": asdict(median) | {"tokens_per_s": median.tokens_per_s},
        "quantization": args.quantization,
        "matmul_tflops": flops / 1e12,
        "weight_matmul_tflops": weight_flops / 1e12,
        ("copy_tb_per_s" if device.type == "cuda" else "read_tb_per_s"): bandwidth / 1e12,
        "roofline": asdict(bound) | {"total_s": bound.total_s},
        "percent_of_roofline": 100 * bound.total_s / median.total_s,
    }
    if profile is not None:
        result["profile"] = profile
        result["profile_prefill"] = prefill_profile
    print_table(result)
    return result


def save_trace_and_plot(llm, args: argparse.Namespace, window: tuple[float, float], roofline_rate: float) -> None:
    """The trace (with the roofline rate) goes to --trace-file; --plot draws the median run from it."""
    from pagedllm.trace.plots import plot_run
    from pagedllm.trace.reader import parse_trace

    tracer = llm.llm_engine.tracer
    tracer.metadata["roofline_output_tokens_per_s"] = roofline_rate
    llm.llm_engine.write_trace()
    if args.plot:
        trace_window = (tracer.seconds(window[0]), tracer.seconds(window[1]))
        plot_run(parse_trace(tracer.trace()), args.plot, trace_window, roofline_rate)
        print(f"plot of the median run written to {args.plot}")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (Linux's /proc/cpuinfo, else what platform knows)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def print_table(result: dict) -> None:
    median, bound, workload = result["median"], result["roofline"], result["workload"]
    on_gpu = "gpu" in result
    where = (
        f"{result['gpu']} x{result['tensor_parallel_size']}"
        if on_gpu
        else f"{result['cpu']}, {result['threads']} thread{'s' if result['threads'] > 1 else ''}"
    )
    print(
        f"\n{result['shape']} ({result['dtype']}) on {where}  "
        f"({'traced, ' if result['traced'] else ''}graphs {'off' if result['enforce_eager'] or not on_gpu else 'on'}, "
        f"block_size {result['block_size']}, {result['num_kv_blocks']} KV blocks of {result['kv_cache_dtype']}, "
        f"load {result['load_s']:.1f} s)"
    )
    print(
        f"workload: nano-vllm's x{workload['scale']:g}: {workload['sequences']} sequences, "
        f"{workload['prompt_tokens']:,} prompt tokens, {workload['output_tokens']:,} output tokens"
    )
    print("| | total (s) | prefill (s) | decode (s) | output tok/s |")
    print("|---|---|---|---|---|")
    for index, run in enumerate(result["runs"]):
        print(
            f"| run {index} | {run['total_s']:.2f} | {run['prefill_s']:.2f} | {run['decode_s']:.2f} "
            f"| {run['tokens_per_s']:,.0f} |"
        )
    print(
        f"| roofline | {bound['total_s']:.2f} | {bound['prefill_s']:.2f} | {bound['decode_s']:.2f} "
        f"| {median['output_tokens'] / bound['total_s']:,.0f} |"
    )
    first, rate = result["runs"][0]["tokens_per_s"], median["tokens_per_s"]
    fp8 = f", fp8 matmul {result['weight_matmul_tflops']:.0f}" if result["quantization"] == "fp8" else ""
    if on_gpu:
        ceilings = f"bf16 matmul {result['matmul_tflops']:.0f}{fp8} TFLOP/s, copy {result['copy_tb_per_s']:.2f} TB/s"
    else:
        ceilings = (f"{result['dtype']} matmul {1e3 * result['matmul_tflops']:.0f} GFLOP/s, memory read "
                    f"{1e3 * result['read_tb_per_s']:.1f} GB/s with the engine's threads")  # fmt: skip
    print(
        f"first run {first:,.0f} output tok/s ({100 * first / rate:.0f}% of the later runs' median); "
        f"median of the later runs {rate:,.0f} output tok/s = {result['percent_of_roofline']:.0f}% of the roofline "
        f"({ceilings} measured)"
    )


def run(args: argparse.Namespace) -> None:
    from pagedllm.config import EngineConfig, resolve_device

    EngineConfig(device=args.device)  # a device torch cannot use: the flag's error, before any work
    device = resolve_device(args.device)
    if device.type == "cpu" and (args.latency or args.profile):
        flag = "--latency" if args.latency else "--profile"
        raise ValueError(f"bench {flag} measures a CUDA GPU (its kernels, a 32,000-token context); on a CPU run "
                         "bench without it")  # fmt: skip
    if args.plot:
        from pagedllm.trace.plots import require_matplotlib

        require_matplotlib()  # before the benchmark, not after it
    if args.latency:
        from pagedllm.entrypoints.bench_latency import run_latency

        checkpoint = Path(args.checkpoint_dir) / args.shape
        if not (checkpoint / "model.safetensors").exists():
            write_random_checkpoint(args.shape, checkpoint, device)
        max_positions = SHAPES[args.shape]["max_position_embeddings"]
        latency = run_latency(str(checkpoint), max_positions, args.profile, **engine_kwargs(args, "bench"))
        result = {"shape": args.shape, "tensor_parallel_size": args.tensor_parallel_size, "latency": latency}
    else:
        result = run_benchmark(args, device)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
