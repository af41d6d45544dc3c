"""EngineConfig: every engine setting, checked once when the LLM is built."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
ATTENTION_BACKENDS = ("torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 with scales (attention/fp8.py)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF model directory or .gguf file; None: the embedded default model
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere
    async_scheduling: bool | None = None  # overlap host bookkeeping with the device's step; None: on for CUDA
    kv_cache_dtype: str = "auto"  # "fp8": half the KV bytes per token of a 16-bit cache

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.block_size & (self.block_size - 1) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto" and normalize_dtype_name(self.dtype) not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or None")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs) -> EngineConfig:
        """Like EngineConfig(...), but an unknown keyword is a TypeError listing the accepted ones."""
        accepted = {field.name for field in fields(cls)}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"unknown LLM argument(s) {unknown}; accepted: {', '.join(sorted(accepted))}")
        return cls(model=model, **kwargs)


def normalize_dtype_name(name: str | torch.dtype) -> str:
    if isinstance(name, torch.dtype):
        return str(name).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for, but torch sees no CUDA GPU; use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | str | None) -> torch.dtype:
    """'auto': float32 on CPU (exact and fast enough there); on GPU the checkpoint's 16-bit dtype, else bfloat16."""
    if name != "auto":
        return DTYPES[normalize_dtype_name(name)]
    if device.type == "cpu":
        return torch.float32
    checkpoint_name = normalize_dtype_name(checkpoint_dtype) if checkpoint_dtype else None
    return DTYPES[checkpoint_name] if checkpoint_name in ("float16", "bfloat16") else torch.bfloat16
