"""EngineConfig: every engine setting, checked once when the LLM is built."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
ATTENTION_BACKENDS = ("torch", "triton")
BLOCK_SIZES = tuple(2**power for power in range(9))  # 1 to 256
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a uint64 (a negative seed wraps around to a positive one)
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 with scales (attention/fp8.py)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | os.PathLike | None = None  # HF model directory or .gguf file; None: the embedded default model
    tokenizer: str | os.PathLike | None = None  # a local tokenizer directory; None: the model's own
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
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
    trace_file: str | os.PathLike | None = None  # write a Chrome/Perfetto trace of every step and request here
    trace_kv_every: int | None = None  # with trace_file: snapshot the KV block pool every this many steps
    kv_cache_dtype: str = "auto"  # "fp8": half the KV bytes per token of a 16-bit cache

    def __post_init__(self) -> None:
        for field in fields(self):
            FIELD_RULES[field.name].validate(field.name, getattr(self, field.name))
        if self.attention_backend == "triton" and resolve_device(self.device).type != "cuda":
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device, but device={self.device!r} is "
                f"{resolve_device(self.device).type}; use attention_backend='torch' or None"
            )
        self.check_trace_file()

    def check_trace_file(self) -> None:
        if self.trace_file is None:
            if self.trace_kv_every is not None:
                raise ValueError("trace_kv_every needs trace_file: the KV snapshots go into the trace")
            return
        if not os.fspath(self.trace_file):
            raise ValueError(f"trace_file must be a file path or None, got {self.trace_file!r}")
        directory = os.path.dirname(os.path.abspath(self.trace_file))
        if not os.path.isdir(directory):
            raise ValueError(f"trace_file {self.trace_file!r}: directory {directory!r} does not exist")

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike | None, **kwargs) -> EngineConfig:
        """Like EngineConfig(...), but an unknown keyword is a TypeError listing the accepted ones."""
        accepted = {field.name for field in fields(cls)}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"unknown LLM argument(s) {unknown}; accepted: {', '.join(sorted(accepted))}")
        return cls(model=model, **kwargs)


@dataclass(frozen=True, slots=True)
class Rule:
    """What one setting may hold: a TypeError unless its type is one of `types` (a bool never passes as an int),
    then a ValueError unless `check` accepts it. Both messages name the setting and say what is `allowed`."""

    types: tuple[type, ...]
    allowed: str | Callable[[], str]  # a callable where the answer depends on the machine
    check: Callable[[object], bool] = lambda value: True

    def validate(self, name: str, value: object) -> None:
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            raise TypeError(f"{name} must be {self.describe()}, got {type(value).__name__} {value!r}")
        if not self.check(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")

    def describe(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed


def is_known_dtype(name: str | torch.dtype) -> bool:
    return name == "auto" or normalize_dtype_name(name) in DTYPES


def is_usable_device(name: str | torch.device) -> bool:
    if name == "auto":
        return True
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string at all ("tpu", "gpu")
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return device.type == "cpu"


def describe_devices() -> str:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus == 0:
        return "'auto' or 'cpu' (torch sees no CUDA GPU, so 'cuda' is not available)"
    return f"'auto', 'cpu', 'cuda' or 'cuda:N' with N from 0 to {num_gpus - 1} (torch sees {num_gpus} CUDA GPU(s))"


def is_positive(value: int) -> bool:
    return value >= 1


def is_positive_or_none(value: int | None) -> bool:
    return value is None or value >= 1


def is_existing_path_or_none(value: str | os.PathLike | None) -> bool:
    return value is None or Path(value).expanduser().exists()


NONE = type(None)
POSITIVE_INT, POSITIVE_INT_OR_NONE, BOOL = "a positive int", "a positive int or None", "True or False"

# One rule per EngineConfig field (a new field adds one line here).
FIELD_RULES: dict[str, Rule] = {
    "model": Rule((str, os.PathLike, NONE), "a model directory or .gguf path (str or os.PathLike), or None"),
    "tokenizer": Rule(
        (str, os.PathLike, NONE),
        "None or the path of an existing local tokenizer directory (pagedllm never downloads from a hub)",
        is_existing_path_or_none,
    ),
    "skip_tokenizer_init": Rule((bool,), BOOL),
    "dtype": Rule((str, torch.dtype), f"'auto' or one of {', '.join(DTYPES)} (a str or torch.dtype)", is_known_dtype),
    "device": Rule((str, torch.device), describe_devices, is_usable_device),
    "seed": Rule(
        (int,), "an int from 0 to 2**64 - 1 (what torch.Generator takes)", lambda value: 0 <= value <= MAX_SEED
    ),
    "max_model_len": Rule((int, NONE), POSITIVE_INT_OR_NONE, is_positive_or_none),
    "max_num_seqs": Rule((int,), POSITIVE_INT, is_positive),
    "max_num_batched_tokens": Rule((int,), POSITIVE_INT, is_positive),
    "block_size": Rule((int,), "a power of two from 1 to 256", lambda value: value in BLOCK_SIZES),
    "enable_prefix_caching": Rule((bool,), BOOL),
    "num_kv_blocks": Rule((int, NONE), POSITIVE_INT_OR_NONE, is_positive_or_none),
    "kv_cache_memory_bytes": Rule((int, NONE), POSITIVE_INT_OR_NONE, is_positive_or_none),
    "gpu_memory_utilization": Rule((float, int), "a number in (0, 1]", lambda value: 0 < value <= 1),
    "enforce_eager": Rule((bool,), BOOL),
    "tensor_parallel_size": Rule((int,), POSITIVE_INT, is_positive),
    "attention_backend": Rule(
        (str, NONE),
        "None (triton on CUDA, torch elsewhere), 'torch' or 'triton'",
        lambda value: value in (None, *ATTENTION_BACKENDS),
    ),
    "async_scheduling": Rule((bool, NONE), "True, False or None (on for CUDA)"),
    "trace_file": Rule((str, os.PathLike, NONE), "a file path (str or os.PathLike) or None"),
    "trace_kv_every": Rule((int, NONE), POSITIVE_INT_OR_NONE, is_positive_or_none),
    "kv_cache_dtype": Rule((str,), f"one of {KV_CACHE_DTYPES}", lambda value: value in KV_CACHE_DTYPES),
}


def normalize_dtype_name(name: str | torch.dtype) -> str:
    if isinstance(name, torch.dtype):
        return str(name).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def resolve_device(name: str | torch.device) -> torch.device:
    """'auto': the first CUDA GPU if torch sees one, else the CPU (the name itself was checked by EngineConfig)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype | str | None
) -> torch.dtype:
    """'auto': float32 on CPU (exact and fast enough there); on GPU the checkpoint's 16-bit dtype, else bfloat16."""
    if name != "auto":
        return DTYPES[normalize_dtype_name(name)]
    if device.type == "cpu":
        return torch.float32
    checkpoint_name = normalize_dtype_name(checkpoint_dtype) if checkpoint_dtype else None
    return DTYPES[checkpoint_name] if checkpoint_name in ("float16", "bfloat16") else torch.bfloat16
