"""Which kernels an engine runs, resolved once at start-up (by EngineConfig.resolve, into ResolvedConfig.kernels) from
the attention backend setting, the device, the model's head_dim, the KV cache dtype and the environment
(pagedllm/envs.py). Every rank's worker builds its model (inside layers.kernel_choices.building_with_kernels), its
attention backend and its sampler with the result, and logs it.
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.attention.selector import choose_backend, triton_installed
from pagedllm.layers.kernel_choices import KernelChoices


def resolve_kernel_choices(
    attention_backend: str | None, device: torch.device, head_dim: int, kv_cache_dtype: str = "auto"
) -> KernelChoices:
    """On CUDA by default: the Triton attention (or torch, with one warning, for a model its kernels cannot take),
    the Triton rotary kernel, and the skinny GEMM, the fused race sampler and torch.compile unless their variables
    turn them off. Plain torch everywhere on CPU, with attention_backend='torch', or without Triton installed.
    Reads the environment now: called once per engine, by EngineConfig.resolve."""
    attention = choose_backend(attention_backend, device, head_dim, kv_cache_dtype)
    on_cuda = device.type == "cuda"
    if not on_cuda or attention_backend == "torch" or not triton_installed():
        return KernelChoices(attention=attention, pin_memory=on_cuda)
    return KernelChoices(
        attention=attention,
        rotary="triton",
        linear="skinny_gemm" if envs.SKINNY_GEMM.get() else "torch",
        sampler="triton_race" if envs.FUSED_SAMPLER.get() else "torch",
        compile=envs.COMPILE.get(),
        pin_memory=True,
    )
