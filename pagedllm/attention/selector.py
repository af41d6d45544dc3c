"""Which attention backend runs a model: the one asked for, except that a model the Triton kernels cannot take, or a
machine where the CPU kernels cannot be built, falls back to the torch backend with one warning instead of failing."""

from __future__ import annotations

import importlib.util

import torch

from pagedllm import cpu_kernels
from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.triton_limits import FP8_MIN_CAPABILITY, TRITON_HEAD_DIM_MULTIPLE, TRITON_MAX_HEAD_DIM
from pagedllm.logger import logger


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_unsupported_reason(device: torch.device, head_dim: int, kv_cache_dtype: str) -> str | None:
    """Why the Triton kernels cannot run this model, or None when they can."""
    if not triton_installed():
        return "triton is not installed"
    if head_dim % TRITON_HEAD_DIM_MULTIPLE or not 0 < head_dim <= TRITON_MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of {TRITON_HEAD_DIM_MULTIPLE} up to {TRITON_MAX_HEAD_DIM}"
    if kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            return f"an fp8 KV cache needs compute capability 8.9 or newer, this GPU has {capability}"
    return None


def default_backend(device: torch.device) -> str:
    """triton on CUDA, cpu (the in-place C++ kernel) on CPU, torch elsewhere."""
    return {"cuda": "triton", "cpu": "cpu"}.get(device.type, "torch")


def choose_backend(name: str | None, device: torch.device, head_dim: int, kv_cache_dtype: str = "auto") -> str:
    """The name of the backend that runs: `name`, or with None the device's default_backend; triton falls back to
    torch where its kernels cannot take the model, cpu where its kernels cannot be built. Call once per engine: a
    fallback logs one warning."""
    name = name or default_backend(device)
    if name == "triton":
        reason = triton_unsupported_reason(device, head_dim, kv_cache_dtype)
        if reason is None:
            return "triton"
        logger.warning("attention: the triton kernels cannot run this model (%s); using the torch backend", reason)
    if name == "cpu":
        reason = cpu_kernels.unavailable_reason()
        if reason is None:
            return "cpu"
        logger.warning("attention: %s; using the torch backend", reason)
    return "torch"


def create_backend(name: str, torch_prompt_sdpa: str = "math") -> AttentionBackend:
    """The backend choose_backend named (importing Triton only for the triton backend); torch_prompt_sdpa: the
    prompt chunks' SDPA kernel of the torch and cpu backends (KernelChoices)."""
    flash_prompts = torch_prompt_sdpa == "flash"
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from pagedllm.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(flash_prompts=flash_prompts)
    from pagedllm.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(flash_prompts=flash_prompts)
