"""EngineConfig: every engine setting, checked once when the LLM is built; ResolvedConfig: the same settings with
every default made concrete for one machine and checkpoint, once, when the engine starts.

Importing this module imports no torch (torch is imported by the checks and resolutions that need it), so the
command line builds its flags from FIELD_RULES and `pagedllm --help` stays fast."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedllm.layers.kernel_choices import KernelChoices
    from pagedllm.models.spec import DecoderSpec

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # torch's names of the dtypes an engine runs in
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
ATTENTION_BACKENDS = ("torch", "triton", "cpu")
BLOCK_SIZES = tuple(2**power for power in range(9))  # 1 to 256
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a uint64 (a negative seed wraps around to a positive one)
# A step's token budget when none is asked for. A CPU takes vLLM's CPU serving default: a prompt step's activations
# then stay under glibc's largest mmap threshold (32 MiB) for the default model, so they reuse heap pages instead of
# faulting new maps in every layer (at 8,192: ~2.5 million faults and 10-14% more time on nano-vllm's prompts;
# benchmarks/NOTES.md, session 33), and decoding rows wait behind a quarter of the prompt tokens.
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 2048
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 with scales (attention/fp8.py)
# The linear layers' weight formats (layers/quantization/); "none" (the command line's None) the same as None
QUANTIZATIONS = ("auto", "none", "fp8", "gguf")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What each field means and may hold is its FIELD_RULES entry; resolve() makes its defaults concrete."""

    model: str | os.PathLike | None = None
    gguf_file: str | None = None
    tokenizer: str | os.PathLike | None = None
    skip_tokenizer_init: bool = False
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    async_scheduling: bool | None = None
    trace_file: str | os.PathLike | None = None
    trace_kv_every: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = "auto"
    threads: int | None = None
    speculative_config: dict | str | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            FIELD_RULES[field.name].validate(field.name, getattr(self, field.name))
        self.speculative()  # a ValueError saying which key is wrong
        needs = {"triton": "cuda", "cpu": "cpu"}.get(self.attention_backend)
        if needs is not None and resolve_device(self.device).type != needs:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} needs a {needs.upper()} device, but "
                f"device={self.device!r} is {resolve_device(self.device).type}; use attention_backend='torch' or None"
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

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (a dict, or its JSON text as a command line gives it); None: no speculation."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike | None, **kwargs) -> EngineConfig:
        """Like EngineConfig(...), but an unknown keyword is a TypeError listing the accepted ones."""
        accepted = {field.name for field in fields(cls)}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"unknown LLM argument(s) {unknown}; accepted: {', '.join(sorted(accepted))}")
        return cls(model=model, **kwargs)

    def resolve(
        self, spec: DecoderSpec, checkpoint_dtype: torch.dtype | str | None, checkpoint_format: str | None = None
    ) -> ResolvedConfig:
        """Every default made concrete, and the kernels chosen, once, for this machine and this checkpoint (its
        DecoderSpec, the dtype its weights are stored in, their format: None, "fp8" or "gguf"); a ValueError when
        max_model_len is past the model's limit or the quantization asked for cannot run here. Reads the kernel
        switches of the environment now (pagedllm/envs.py)."""
        from pagedllm.kernel_selection import asked_attention_backend, resolve_kernel_choices, resolve_quantization

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device, checkpoint_dtype)
        max_model_len = resolve_max_model_len(self.max_model_len, spec)
        async_scheduling = device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
        max_num_batched_tokens = self.max_num_batched_tokens or (
            GPU_BATCHED_TOKENS if device.type == "cuda" else CPU_BATCHED_TOKENS
        )
        attention_backend = asked_attention_backend(self.attention_backend, device)
        quantization = resolve_quantization(self.quantization, device, checkpoint_format, self.attention_backend)
        kernels = resolve_kernel_choices(
            attention_backend=attention_backend, device=device, head_dim=spec.head_dim,
            kv_cache_dtype=self.kv_cache_dtype, quantization=quantization,
        )  # fmt: skip
        config = replace(
            self, device=device, dtype=dtype, max_model_len=max_model_len, async_scheduling=async_scheduling,
            max_num_batched_tokens=max_num_batched_tokens, attention_backend=attention_backend,
            quantization=quantization and quantization.split("_")[0],
        )  # fmt: skip
        threads, threads_source = (self.threads, "asked for") if self.threads is not None else default_threads()
        config = replace(config, threads=threads)
        speculative = self.speculative()
        if speculative is not None:
            speculative.check_engine(config)
        return ResolvedConfig(
            config, device, dtype, max_model_len, async_scheduling, kernels, threads, threads_source, speculative
        )


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """An EngineConfig with nothing left to decide: what the engine and the executor run with. Resolved once, on
    rank 0 (torchrun: in rank 0's process), and handed to every rank's Worker as it is."""

    config: EngineConfig  # the settings, each default replaced by the value below (what the executor's ranks read)
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    async_scheduling: bool  # overlapped steps: on by default for CUDA
    # Which kernels run. kernels.attention is the backend that runs: config.attention_backend is the one asked for
    # (or the device's default), and a model the Triton kernels cannot take falls back to torch in attention alone.
    kernels: KernelChoices
    threads: int  # torch's CPU threads in the engine's process (each CPU tensor-parallel rank takes a share)
    threads_source: str  # why that many, for the start-up line
    speculative: SpeculativeConfig | None = None  # config.speculative_config parsed; None: no speculation

    @property
    def max_sampled_rows(self) -> int:
        """The most rows one step samples: one per state index, and with speculation k more for each verifying one."""
        k = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        return self.config.max_num_seqs * (1 + k)


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's rule for n-gram lookup lengths: both unset, 5 and 5; one set, the other the same.
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's speculative_config, checked: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b} or {"method": "draft_model", "model": path, "num_speculative_tokens": k}; with either,
    "disable_by_batch_size": n (a step with more running sequences than n speculates for none; null: never; unset:
    DEFAULT_DISABLE_BY_BATCH_SIZE, where vLLM's is never: on CPU a draft at 8 sequences cost 0.4 decode steps, at one
    0.05, spec_decode/backoff.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: the shortest suffix looked up in the sequence's earlier tokens
    prompt_lookup_max: int = 0  # ngram: the longest (tried first)
    model: str | None = None  # draft_model: its checkpoint, which shares the target's tokenizer
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: dict | str | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")
        accepted = [field.name for field in fields(cls)]
        unknown = sorted(set(value) - set(accepted))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; accepted: {', '.join(accepted)}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            number = value.get(key)
            if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
                raise ValueError(f"speculative_config.{key} must be a positive int, got {number!r}")
        if value.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens: how many tokens each step proposes")
        if method == "ngram":
            return cls.ngram(value)
        return cls.draft_model(value)

    @classmethod
    def ngram(cls, value: dict) -> SpeculativeConfig:
        if value.get("model") is not None:
            raise ValueError("speculative_config: method 'ngram' takes no model (it looks up the sequence's tokens)")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}")
        return cls(
            "ngram",
            value["num_speculative_tokens"],
            low,
            high,
            None,
            value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
        )

    @classmethod
    def draft_model(cls, value: dict) -> SpeculativeConfig:
        model = value.get("model")
        if not isinstance(model, str | os.PathLike) or not os.fspath(model):
            raise ValueError("speculative_config: method 'draft_model' needs model, the draft's checkpoint path")
        if value.get("prompt_lookup_min") is not None or value.get("prompt_lookup_max") is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram', not 'draft_model'")
        k = value["num_speculative_tokens"]
        return cls(
            "draft_model",
            k,
            model=os.fspath(model),
            disable_by_batch_size=value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE),
        )

    def check_engine(self, config: EngineConfig) -> None:
        """What the engine cannot speculate with yet: a ValueError saying what to change."""
        if self.method == "draft_model" and config.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only")


@dataclass(frozen=True, slots=True)
class Rule:
    """What one setting does (`doc`, also its command-line flag's help) and may hold: a TypeError unless its type is
    one of `types` or `torch_types` (a bool never passes as an int), then a ValueError unless `check` accepts it. Both
    messages name the setting and say what is `allowed`."""

    doc: str
    types: tuple[type, ...]
    allowed: str | Callable[[], str]  # a callable where the answer depends on the machine
    check: Callable[[object], bool] = lambda value: True
    # torch classes also accepted, by name: reading the rules imports no torch, and no value can be an instance of a
    # torch class before torch is imported
    torch_types: tuple[str, ...] = ()

    def accepted_types(self) -> tuple[type, ...]:
        torch = sys.modules.get("torch")
        return self.types + (tuple(getattr(torch, name) for name in self.torch_types) if torch else ())

    def validate(self, name: str, value: object) -> None:
        types = self.accepted_types()
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise TypeError(f"{name} must be {self.describe()}, got {type(value).__name__} {value!r}")
        if not self.check(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")

    def describe(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed


def is_known_dtype(name: str | torch.dtype) -> bool:
    return name == "auto" or normalize_dtype_name(name) in DTYPE_NAMES


def is_usable_device(name: str | torch.device) -> bool:
    if name == "auto":
        return True
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string at all ("tpu", "gpu")
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return device.type == "cpu"


def describe_devices() -> str:
    import torch

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

# One rule per EngineConfig field (a new field adds one entry here; its flag on every command follows from it).
FIELD_RULES: dict[str, Rule] = {
    "model": Rule(
        "Hugging Face model directory, .gguf file or hub id (org/name, through the Hugging Face cache; "
        "HF_HUB_OFFLINE=1 reads the cache alone); None: the embedded default model (SmolLM2-135M-Instruct)",
        (str, os.PathLike, NONE),
        "a model directory, .gguf path or hub id (str or os.PathLike), or None",
    ),
    "gguf_file": Rule(
        "the .gguf file to load when the model is a directory or hub repository holding several (one alone is "
        "picked by itself)",
        (str, NONE),
        "None or the name of a .gguf file in the model's directory or repository",
    ),
    "tokenizer": Rule(
        "a local tokenizer directory; None: the model's own",
        (str, os.PathLike, NONE),
        "None or the path of an existing local tokenizer directory (pagedllm never downloads from a hub)",
        is_existing_path_or_none,
    ),
    "skip_tokenizer_init": Rule("no tokenizer: prompts are token ids, outputs carry no text", (bool,), BOOL),
    "dtype": Rule(
        "the weights' and activations' dtype; auto: float32 on CPU, on GPU the checkpoint's 16-bit dtype or bfloat16",
        (str,),
        f"'auto' or one of {', '.join(DTYPE_NAMES)} (a str or torch.dtype)",
        is_known_dtype,
        torch_types=("dtype",),
    ),
    "device": Rule(
        "where the model runs: cpu, cuda, cuda:1 ...; auto: the first CUDA GPU if torch sees one, else the CPU",
        (str,),
        describe_devices,
        is_usable_device,
        torch_types=("device",),
    ),
    "seed": Rule(
        "random seed of sampling, for requests that set none of their own",
        (int,),
        "an int from 0 to 2**64 - 1 (what torch.Generator takes)",
        lambda value: 0 <= value <= MAX_SEED,
    ),
    "max_model_len": Rule(
        "longest prompt + output in tokens; None: the model's limit",
        (int, NONE),
        POSITIVE_INT_OR_NONE,
        is_positive_or_none,
    ),
    "max_num_seqs": Rule("most sequences in a batch (and in the scheduler at once)", (int,), POSITIVE_INT, is_positive),
    "max_num_batched_tokens": Rule(
        f"token budget per step; None: {GPU_BATCHED_TOKENS} on a GPU, {CPU_BATCHED_TOKENS} on a CPU",
        (int, NONE),
        f"a positive int or None ({GPU_BATCHED_TOKENS} on a GPU, {CPU_BATCHED_TOKENS} on a CPU)",
        is_positive_or_none,
    ),
    "block_size": Rule(
        "tokens per KV cache block", (int,), "a power of two from 1 to 256", lambda value: value in BLOCK_SIZES
    ),
    "enable_prefix_caching": Rule("reuse the KV blocks of a prompt prefix computed before", (bool,), BOOL),
    "num_kv_blocks": Rule(
        "KV cache blocks; None: sized from kv_cache_memory_bytes, else from the memory left",
        (int, NONE),
        POSITIVE_INT_OR_NONE,
        is_positive_or_none,
    ),
    "kv_cache_memory_bytes": Rule(
        "bytes for the KV cache, unless num_kv_blocks sets it; None: on CUDA what gpu_memory_utilization leaves, "
        "on CPU a share of free memory",
        (int, NONE),
        POSITIVE_INT_OR_NONE,
        is_positive_or_none,
    ),
    "gpu_memory_utilization": Rule(
        "share of the GPU's memory for weights, activations and KV cache",
        (float, int),
        "a number in (0, 1]",
        lambda value: 0 < value <= 1,
    ),
    "enforce_eager": Rule("no CUDA graphs: every step launched op by op", (bool,), BOOL),
    "tensor_parallel_size": Rule(
        "split the model over this many processes, one per GPU (or CPU ranks); 1: one process",
        (int,),
        POSITIVE_INT,
        is_positive,
    ),
    "attention_backend": Rule(
        "the attention kernels",
        (str, NONE),
        "None (triton on CUDA, cpu on CPU), 'torch', 'triton' or 'cpu'",
        lambda value: value in (None, *ATTENTION_BACKENDS),
    ),
    "async_scheduling": Rule(
        "overlap host bookkeeping with the device's step; None: on for CUDA",
        (bool, NONE),
        "True, False or None (on for CUDA)",
    ),
    "trace_file": Rule(
        "write a Chrome/Perfetto trace of every step and request here (see `pagedllm trace-summary`)",
        (str, os.PathLike, NONE),
        "a file path (str or os.PathLike) or None",
    ),
    "trace_kv_every": Rule(
        "with trace_file: snapshot the KV block pool every this many steps",
        (int, NONE),
        POSITIVE_INT_OR_NONE,
        is_positive_or_none,
    ),
    "kv_cache_dtype": Rule(
        "the KV cache's values: auto, the model's dtype; fp8, float8 e4m3 with scales (twice the tokens of 16 bits)",
        (str,),
        f"one of {KV_CACHE_DTYPES}",
        lambda value: value in KV_CACHE_DTYPES,
    ),
    "threads": Rule(
        "torch's CPU threads for the engine: None, the cores this process may use (its CPU affinity, capped by a "
        "cgroup CPU quota) but one, so that a busy neighbour slows one thread down instead of stalling every parallel "
        "op",
        (int, NONE),
        POSITIVE_INT_OR_NONE,
        is_positive_or_none,
    ),
    "speculative_config": Rule(
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}; None: off',
        (dict, str, NONE),
        "None, a dict or its JSON text (vLLM's speculative_config)",
    ),
    "quantization": Rule(
        "the linear layers' weights: auto, the checkpoint's where the device runs it (an FP8 checkpoint's fp8 on a "
        "GPU of compute capability 9.0+, a GGUF file's blocks on CPU), else dequantized; fp8, float8 e4m3 with "
        "scales on such a GPU (a 16-bit checkpoint quantized at load); gguf, a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/"
        "Q8_0/Q4_K/Q5_K blocks kept on CPU (other types dequantized); None or none, the model's dtype (any "
        "checkpoint dequantized)",
        (str, NONE),
        f"None or one of {QUANTIZATIONS}",
        lambda value: value is None or value in QUANTIZATIONS,
    ),
}


def normalize_dtype_name(name: str | torch.dtype) -> str:
    if not isinstance(name, str):  # a torch.dtype
        return str(name).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs a cgroup quota allows this process (cgroup v2 cpu.max, or v1 cfs_quota_us / cfs_period_us), None
    without a quota."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> tuple[int, str]:
    """How many cores this process may run on, and what says so: its CPU affinity, capped by a cgroup quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    if quota is not None and int(quota) < affinity:
        return max(1, int(quota)), f"a cgroup quota of {quota:g} CPUs"
    return affinity, f"{affinity} core{'s' if affinity > 1 else ''} in its CPU affinity"


def default_threads() -> tuple[int, str]:
    """All usable cores but one (a busy neighbour then slows one thread down instead of stalling every parallel op:
    on 2 cores with one busy, 2 threads took 1.5x as long as 1), and why."""
    cores, source = usable_cores()
    if cores == 1:
        return 1, source
    return cores - 1, f"{source}, one left for other work"


def resolve_device(name: str | torch.device) -> torch.device:
    """'auto': the first CUDA GPU if torch sees one, else the CPU (the name itself was checked by EngineConfig)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str | torch.dtype, device: torch.device, checkpoint_dtype: torch.dtype | str | None
) -> torch.dtype:
    """'auto': float32 on CPU (exact and fast enough there); on GPU the checkpoint's 16-bit dtype, else bfloat16."""
    import torch

    if name != "auto":
        return getattr(torch, normalize_dtype_name(name))
    if device.type == "cpu":
        return torch.float32
    checkpoint_name = normalize_dtype_name(checkpoint_dtype) if checkpoint_dtype else None
    return getattr(torch, checkpoint_name) if checkpoint_name in ("float16", "bfloat16") else torch.bfloat16


def resolve_max_model_len(requested: int | None, spec: DecoderSpec) -> int:
    """None: the model's limit, its positions or its sliding window if smaller (attention is exact only inside it)."""
    limit = spec.max_position_embeddings
    if spec.sliding_window:
        limit = min(limit, spec.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} positions")
    return requested
