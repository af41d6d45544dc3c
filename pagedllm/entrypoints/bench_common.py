"""What `pagedllm bench`, `bench --latency` and benchmarks/ share: shapes and their random checkpoints, nano-vllm's
workload (scaled for a CPU), a GPU's and a CPU's ceilings, CUDA-event timing, device time per step from a profiler.
torch is imported inside the functions that use it, so `pagedllm bench --help` reads SHAPES alone."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES = {
    # The embedded default model (SmolLM2-135M-Instruct): the shape a laptop's CPU runs in seconds
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "tinyllama-1.1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=2048 * 2,
    ),
    "llama3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), rope_theta=500000.0,
    ),
    # The 8B class users serve on an H200, where fp8 weights pay (benchmarks/NOTES.md, "FP8 weights"): 16 GB of bf16
    "llama3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), rope_theta=500000.0,
    ),
}  # fmt: skip


def write_random_checkpoint(shape: str, directory: Path, device: torch.device, **overrides) -> Path:
    """config.json + model.safetensors of random bf16 weights (std 0.02, norms 1) with the shape's names; overrides
    replace config fields of the shape (e.g. vocab_size, to match a tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**SHAPES[shape], **overrides}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, param in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            random_values = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
            tensors[name] = (random_values * 0.02).to(torch.bfloat16).cpu()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config.save_pretrained(directory)
    return directory


NANO_VLLM_LENGTHS = (100, 1024)  # its prompt and its output lengths are uniform in this range


def scaled_workload(num_seqs: int, scale: float) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload with `scale` x the sequences and scale x the prompt and output lengths (at least 1)."""
    low, high = (max(1, round(scale * length)) for length in NANO_VLLM_LENGTHS)
    return nano_vllm_workload(max(1, round(scale * num_seqs)), (low, high), (low, high))


def nano_vllm_workload(
    num_seqs: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    max_token_id: int = 10000,
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload (its ranges by default), with the same random sequence: prompts of random token ids in
    [0, max_token_id], lengths uniform in input_len; output lengths uniform in output_len."""
    random.seed(0)
    prompts = [[random.randint(0, max_token_id) for _ in range(random.randint(*input_len))] for _ in range(num_seqs)]
    output_lens = [random.randint(*output_len) for _ in range(num_seqs)]
    return prompts, output_lens


def measure_ceilings(device: torch.device, fp8: bool = False) -> tuple[float, float, float]:
    """(bf16 matmul FLOP/s on random data, the matmul rate the linear layers' weights run at: fp8's through
    torch._scaled_mm with row scales when fp8, else the bf16 rate again, device copy bytes/s counting read + write),
    medians of 10."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    source = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    target = torch.empty_like(source)
    matmul_flops = 2 * 8192**3 / (median_cuda_ms(lambda: a @ b) / 1e3)
    copy_bytes = 2 * source.nbytes / (median_cuda_ms(lambda: target.copy_(source)) / 1e3)
    weight_flops = matmul_flops
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        scale_a = torch.ones(8192, 1, device=device)
        scale_b = torch.ones(1, 8192, device=device)
        fp8_ms = median_cuda_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a, scale_b, out_dtype=torch.bfloat16))
        weight_flops = 2 * 8192**3 / (fp8_ms / 1e3)
    return matmul_flops, weight_flops, copy_bytes


def measure_cpu_ceilings(dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s in `dtype`, memory bandwidth in bytes/s) of this process's CPU threads, medians of 3. The
    bandwidth is that of reading 512 MiB (a sum), as a decode step reads its weights and KV."""
    import torch

    size = 2048
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    values = torch.ones(1 << 27, dtype=torch.float32)  # 512 MiB: past every cache
    matmul_s = median_host_s(lambda: a @ b)
    read_s = median_host_s(lambda: values.sum())
    return 2 * size**3 / matmul_s, values.nbytes / read_s


def median_host_s(function, repeats: int = 3, warmup: int = 1) -> float:
    """The median wall time of `repeats` calls of `function` (CPU work: it is done when the call returns)."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_cuda_ms(function, repeats: int = 10, warmup: int = 3) -> float:
    """The median of `repeats` calls of `function`, each timed by CUDA events, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_time_per_step(profiler, num_steps: int) -> dict:
    """Kernel time per step read from a torch.profiler run (kernels inside CUDA graphs included), and the part
    spent in NCCL collectives: tensor parallelism's all-reduces (which include waiting for the slowest rank)."""
    from torch.autograd import DeviceType

    kernels = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    collectives = [event for event in kernels if "nccl" in event.name.lower()]
    return {
        "kernels_per_step": len(kernels) / num_steps,
        "kernel_ms_per_step": sum(event.time_range.elapsed_us() for event in kernels) / num_steps / 1e3,
        "all_reduce_ms_per_step": sum(event.time_range.elapsed_us() for event in collectives) / num_steps / 1e3,
        "all_reduces_per_step": len(collectives) / num_steps,
    }
