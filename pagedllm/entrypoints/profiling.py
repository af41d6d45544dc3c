"""What `pagedllm bench` and `bench --latency` read from a torch.profiler run: device kernel time per step."""

from __future__ import annotations


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
