"""Every environment variable pagedllm reads, declared once: name, type, default and what it does. A value is read
when it is asked for (at start-up, by whoever needs it), never at import, so a variable set before LLM() counts.

os.environ is read in this module only (tests/test_envs.py checks the package for it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"expected one of {TRUE_WORDS + FALSE_WORDS}")


def parse_choice(text: str, choices: tuple[str, ...]) -> str:
    word = text.strip().lower()
    if word not in choices:
        raise ValueError(f"expected one of {choices}")
    return word


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    """One variable. Unset or empty: `default`; anything else is parsed, and a value that does not parse is a
    ValueError that names the variable."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    set_by: str = "the user"  # "torchrun": the launcher sets it for each rank it starts

    def get(self) -> T:
        text = os.environ.get(self.name, "")
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as error:
            raise ValueError(f"{self.name}={text!r} is not valid: {error}") from None


FUSED_SAMPLER = EnvVar(
    "PAGEDLLM_FUSED_SAMPLER", parse_bool, True,
    "On CUDA, batches of greedy and temperature-only rows race in one Triton kernel (kernels/race_sampling.py); "
    "0: the torch path.",
)  # fmt: skip
SKINNY_GEMM = EnvVar(
    "PAGEDLLM_SKINNY_GEMM", parse_bool, True,
    "On CUDA, the projections of one-row decode steps go to the GEMV kernel, and of small ones to the skinny-GEMM "
    "kernel where it beats cuBLAS (kernels/skinny_gemm.py); 0: F.linear always (an A/B switch for benchmarks).",
)  # fmt: skip
ONEDNN_LINEAR = EnvVar(
    "PAGEDLLM_ONEDNN_LINEAR", parse_bool, True,
    "On CPU, the linear layers' weights are reordered once for oneDNN, which runs their products (faster than "
    "aten::mm at every row count measured); 0: F.linear (an A/B switch for benchmarks).",
)  # fmt: skip
CPU_FLOAT_GEMM = EnvVar(
    "PAGEDLLM_CPU_FLOAT_GEMM", parse_bool, True,
    "On CPU, float32 weights are packed once into panels for the C++ product (layers/cpu_float_gemm.cpp: oneDNN's "
    "results, faster at a decode step's rows) where the CPU kernels build; 0: oneDNN (an A/B switch for benchmarks).",
)  # fmt: skip
CPU_LAYER_OPS = EnvVar(
    "PAGEDLLM_CPU_LAYER_OPS", parse_bool, True,
    "On CPU, a layer's norms, SiLU-and-mul, q/k rotation and KV store run as one C++ call each "
    "(layers/cpu_layer_ops.cpp) where the CPU kernels build; 0: the torch expressions (an A/B switch for benchmarks).",
)  # fmt: skip
CPU_DECODE_STACK = EnvVar(
    "PAGEDLLM_CPU_DECODE_STACK", parse_bool, True,
    "On CPU with the C++ layer ops and attention, a step whose rows all decode runs every decoder layer in one C++ "
    "call (models/cpu_decode_stack.cpp); 0: the layers' modules one by one (an A/B switch for benchmarks).",
)  # fmt: skip
GGUF_FLOAT_PROMPTS = EnvVar(
    "PAGEDLLM_GGUF_FLOAT_PROMPTS", parse_bool, True,
    "On CPU with GGUF blocks kept, a step's prompt-chunk rows multiply each weight dequantized to float32 (and take "
    "SDPA's flash kernel); 0: the grouped-integer kernel and SDPA's math path, as the rows that decode.",
)  # fmt: skip
COMPILE = EnvVar(
    "PAGEDLLM_COMPILE", parse_bool, True,
    "On CUDA, the element-wise functions (norms, rotary, SiLU, the sampler's race and penalties) run through "
    "torch.compile (layers/compile.py); 0: eager.",
)  # fmt: skip
FP8_SCALING = EnvVar(
    "PAGEDLLM_FP8_SCALING", lambda text: parse_choice(text, ("rows", "blocks")), "rows",
    "With fp8 weights: rows, one scale per output row of a weight and per token of the activations; blocks, one per "
    "128 x 128 block of a weight and per 128 columns of a token (in_features must divide by 128).",
)  # fmt: skip
CACHE_DIR = EnvVar(
    "PAGEDLLM_CACHE_DIR", Path, None,
    "Where converted GGUF checkpoints are cached; unset: ~/.cache/pagedllm.",
)  # fmt: skip
API_KEY = EnvVar(
    "PAGEDLLM_API_KEY", str, None,
    "The key `pagedllm serve` asks clients for when --api-key is not given; unset: no key.",
)  # fmt: skip
LOG_LEVEL = EnvVar(
    "PAGEDLLM_LOG_LEVEL", str.upper, "INFO",
    "The pagedllm logger's level (WARNING silences the start-up lines). Read when pagedllm.logger is imported: "
    "the one variable read at import, since logging must be set up before anything logs.",
)  # fmt: skip

# Set by torchrun for each rank it launches (env:// rendezvous); read to join the group.
RANK = EnvVar("RANK", int, None, "This process's rank in the group; unset: not launched by torchrun.", "torchrun")
WORLD_SIZE = EnvVar("WORLD_SIZE", int, 1, "How many ranks torchrun launched.", "torchrun")
LOCAL_RANK = EnvVar("LOCAL_RANK", int, 0, "This rank's index on its host: its GPU from the configured one.", "torchrun")
LOCAL_WORLD_SIZE = EnvVar("LOCAL_WORLD_SIZE", int, None, "How many ranks run on this host.", "torchrun")
MASTER_ADDR = EnvVar(
    "MASTER_ADDR", str, "127.0.0.1",
    "The host of rank 0's store; ranks the LLM spawns itself meet there too.", "torchrun",
)  # fmt: skip
MASTER_PORT = EnvVar(
    "MASTER_PORT", int, 0,
    "The port of rank 0's store; 0 (the default for spawned ranks): a free port, so engines never collide.",
    "torchrun",
)  # fmt: skip

ALL: tuple[EnvVar, ...] = (
    FUSED_SAMPLER, SKINNY_GEMM, ONEDNN_LINEAR, CPU_FLOAT_GEMM, CPU_LAYER_OPS, CPU_DECODE_STACK, GGUF_FLOAT_PROMPTS,
    COMPILE, FP8_SCALING, CACHE_DIR, API_KEY, LOG_LEVEL, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT,
)  # fmt: skip
