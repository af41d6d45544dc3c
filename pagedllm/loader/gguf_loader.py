"""Load a GGUF file (llama.cpp's format) as a transformers config, a fast tokenizer and float tensors named as in
a Hugging Face checkpoint, so the rest of the engine never sees GGUF names, quantized blocks or llama.cpp's layout.
The converted result is cached as safetensors keyed by the file's content hash, which makes later loads much faster.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm import envs
from pagedllm.loader.checkpoint_tensor import CheckpointTensor, QuantizedBlocks
from pagedllm.logger import logger

# general.architecture -> the transformers config class of that family
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

# GGUF tensor names (without the .weight/.bias suffix) -> Hugging Face names; per-layer ones live under blk.N.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama-3 rope scaling is stored as this tensor of per-frequency divisors rather than as metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"

FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
# The types gguf's reader maps as numbers rather than bytes
MAPPED_DTYPES = {
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}  # fmt: skip
INDEX_FILE = "gguf_tensors.json"

CACHE_FORMAT_VERSION = 1  # bump when the conversion changes, so stale cache entries are never read


@dataclass(slots=True)
class GGUFCheckpoint:
    """What a GGUF file holds, in the form the engine loads from a Hugging Face checkpoint."""

    config: PretrainedConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names -> dense tensors in the requested dtype, on CPU
    tokenizer: PreTrainedTokenizerBase


def load_gguf(
    path: str | Path, dtype: torch.dtype, *, use_cache: bool = True, cache_dir: str | Path | None = None
) -> GGUFCheckpoint:
    """Read `path`; with `use_cache`, reuse or write a converted copy under `cache_dir` (default_cache_dir()).

    Raises FileNotFoundError for a missing file and ValueError for a file that is not a readable GGUF or holds an
    architecture or tensor type this loader does not support.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if not use_cache:
        return _convert(path, dtype)
    entry = Path(cache_dir or default_cache_dir()) / _cache_key(path, dtype)
    if not entry.is_dir():
        checkpoint = _convert(path, dtype)
        _write_cache(checkpoint, entry)
        return checkpoint
    return _read_cache(entry)


def default_cache_dir() -> Path:
    """$PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""
    return envs.CACHE_DIR.get() or Path.home() / ".cache" / "pagedllm"


def converted_copy(path: Path, write: bool) -> Path | None:
    """The cached float32 conversion of `path` (a Hugging Face directory: config, tokenizer, model.safetensors).
    When there is none: with `write`, convert and cache it now; otherwise, or if it cannot be written, None."""
    entry = default_cache_dir() / _cache_key(path, torch.float32)
    if write and not entry.is_dir():
        logger.info(
            "converting %s (%.0f MB) to float32 once, into %s (PAGEDLLM_CACHE_DIR sets where); later starts read it",
            path.name, path.stat().st_size / 1e6, entry,
        )  # fmt: skip
        started = time.perf_counter()
        _write_cache(_convert(path, torch.float32), entry)
        size = sum(file.stat().st_size for file in entry.rglob("*") if file.is_file()) if entry.is_dir() else 0
        logger.info("converted in %.1f s: %.0f MB on disk", time.perf_counter() - started, size / 1e6)
    return entry if entry.is_dir() else None


def build_tokenizer(path: Path, write_cache: bool, reader: gguf.GGUFReader | None = None) -> PreTrainedTokenizerBase:
    """The file's tokenizer, from its cached copy (transformers' conversion took ~5-13 s for SmolLM2's here, most of
    it reading the file's vocabulary again); without one, converted now, and cached with `write_cache`. reader: the
    file already open, if it is."""
    entry = default_cache_dir() / _cache_key(path, "tokenizer")
    if entry.is_dir():
        return AutoTokenizer.from_pretrained(entry)
    tokenizer = _build_tokenizer(reader or _open_reader(path), path)
    if write_cache:
        _write_entry(entry, tokenizer.save_pretrained)
    return tokenizer


def _convert(path: Path, dtype: torch.dtype) -> GGUFCheckpoint:
    reader = _open_reader(path)
    architecture = _architecture(reader, path)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = _build_config(reader, architecture, tensor_names, path)
    tensors = _read_tensors(reader, config, architecture, dtype, path)
    tokenizer = build_tokenizer(path, write_cache=False, reader=reader)
    return GGUFCheckpoint(config, tensors, tokenizer)


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as error:  # what gguf raises on bad magic, truncation, short arrays
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated?): {error}") from error


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: gguf.GGUFReader, path: Path) -> str:
    architecture = _field(reader, "general.architecture")
    if architecture not in CONFIG_CLASSES:
        raise ValueError(
            f"{path} holds a {architecture!r} model; supported GGUF architectures: {', '.join(CONFIG_CLASSES)}"
        )
    return architecture


# ---- config ----------------------------------------------------------------------------------------------------


def _build_config(reader: gguf.GGUFReader, arch: str, tensor_names: set[str], path: Path) -> PretrainedConfig:
    def required(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path} lacks the GGUF metadata key {arch}.{key}")
        return value

    hidden_size, num_heads = required("embedding_length"), required("attention.head_count")
    # key_length is written when head_dim differs from hidden/heads (Qwen3); full rotary: rope dims == head_dim
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    head_dim = head_dim or hidden_size // num_heads
    rope_theta = _field(reader, f"{arch}.rope.freq_base")
    fields = {
        "hidden_size": hidden_size,
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "intermediate_size": required("feed_forward_length"),
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, rope_theta or 10000.0, path),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "vocab_size": _field(reader, f"{arch}.vocab_size") or _token_count(reader, path),
        # llama.cpp omits output.weight exactly when the head shares the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names if arch == "llama" else None,  # Qwen2 always has it
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    config_class = CONFIG_CLASSES[arch]
    # absent keys (None) fall back to the family's own defaults
    config = config_class(**{key: value for key, value in fields.items() if value is not None})
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    return config


def _token_count(reader: gguf.GGUFReader, path: Path) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has neither a vocab_size nor a tokenizer.ggml.tokens list")
    return len(tokens.data)  # one data index per array element: counts without decoding the strings


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float, path: Path) -> dict | None:
    rope_freqs = next((tensor for tensor in reader.tensors if tensor.name == ROPE_FREQS_TENSOR), None)
    if rope_freqs is not None:
        return _llama3_scaling(np.asarray(rope_freqs.data, dtype=np.float64), head_dim, theta, path)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling_type == "yarn":
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{path} uses rope scaling {scaling_type!r}; supported: none, linear, yarn, llama3")


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float, path: Path) -> dict:
    """Recover Llama-3's rope parameters from the divisors llama.cpp stores, checking they reproduce them."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,  # Llama 3.1-3.3 all use these three
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_divisors(scaling, head_dim, theta), divisors, rtol=1e-4):
        raise ValueError(f"{path} has a {ROPE_FREQS_TENSOR} tensor that is not Llama-3 rope scaling")
    return scaling


def _llama3_divisors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs: how much each rotary frequency is slowed down."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelengths = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelengths - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, between))


# ---- tensors ---------------------------------------------------------------------------------------------------


def _read_tensors(
    reader: gguf.GGUFReader, config: PretrainedConfig, arch: str, dtype: torch.dtype, path: Path
) -> dict[str, torch.Tensor]:
    return {
        hf_name(tensor.name, path): _dense(tensor, config, arch, path).to(dtype).contiguous()
        for tensor in reader.tensors
        if tensor.name != ROPE_FREQS_TENSOR  # already folded into config.rope_scaling
    }


def _dense(tensor: gguf.ReaderTensor, config: PretrainedConfig, arch: str, path: Path) -> torch.Tensor:
    """One tensor dequantized to float32 in Hugging Face's layout."""
    weight = torch.from_numpy(_dequantize(tensor, path))
    name = hf_name(tensor.name, path)
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # weights and biases alike
        num_heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        weight = unpermute_rotary(weight, num_heads)
    return weight


@dataclass(frozen=True, slots=True)
class MappedTensor:
    """A tensor of the file as gguf's reader describes it (name, type, dimensions fastest first, data: a view of the
    file's memory map), from the cached index without parsing the metadata again."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """What opening a GGUF file needs of its metadata: the config, and where each tensor lies."""

    config: PretrainedConfig
    architecture: str
    tensors: list[dict]  # name, type (a GGMLQuantizationType name), shape (fastest first), offset, byte count

    def mapped(self, path: Path) -> Iterator[MappedTensor]:
        file = np.memmap(path, dtype=np.uint8, mode="r")
        for entry in self.tensors:
            tensor_type = gguf.GGMLQuantizationType[entry["type"]]
            data = file[entry["offset"] : entry["offset"] + entry["bytes"]]
            shape = tuple(reversed(entry["shape"]))
            if tensor_type in MAPPED_DTYPES:
                data = data.view(MAPPED_DTYPES[tensor_type]).reshape(shape)
            else:
                data = data.reshape(gguf.quant_shape_to_byte_shape(shape, tensor_type))
            yield MappedTensor(entry["name"], tensor_type, tuple(entry["shape"]), data)


def gguf_index(path: Path, write_cache: bool) -> GGUFIndex:
    """The file's config and tensor table, from its cache entry (gguf's reader parses the whole vocabulary to open a
    file: 5-25 s for SmolLM2's here); without one, read now, and cached with `write_cache`."""
    entry = default_cache_dir() / _cache_key(path, "index")
    if (entry / INDEX_FILE).is_file():
        config = AutoConfig.from_pretrained(entry)
        return GGUFIndex(config, json.loads((entry / INDEX_FILE).read_text())["architecture"], _index_tensors(entry))
    reader = _open_reader(path)
    architecture = _architecture(reader, path)
    config = _build_config(reader, architecture, {tensor.name for tensor in reader.tensors}, path)
    tensors = [
        {
            "name": tensor.name, "type": tensor.tensor_type.name, "shape": [int(dim) for dim in tensor.shape],
            "offset": int(tensor.data_offset), "bytes": int(tensor.n_bytes),
        }
        for tensor in reader.tensors
    ]  # fmt: skip
    if write_cache:

        def write(staging: Path) -> None:
            config.save_pretrained(staging)
            (staging / INDEX_FILE).write_text(json.dumps({"architecture": architecture, "tensors": tensors}))

        _write_entry(entry, write)
    return GGUFIndex(config, architecture, tensors)


def _index_tensors(entry: Path) -> list[dict]:
    return json.loads((entry / INDEX_FILE).read_text())["tensors"]


def lazy_gguf_tensors(path: Path, index: GGUFIndex, dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Without a converted copy: each tensor is dequantized only when read, and only the part read is kept. A tensor
    in quantized blocks can also be read as its blocks (CheckpointTensor.read_blocks), rows in Hugging Face's order."""
    config, architecture = index.config, index.architecture
    for tensor in index.mapped(path):
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        name = hf_name(tensor.name, path)

        def read_slices(slices: tuple[slice, ...], tensor=tensor) -> torch.Tensor:
            return _dense(tensor, config, architecture, path)[slices].clone()

        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        blocks = _quantized_blocks(tensor, config, architecture, name) if len(shape) == 2 else None
        yield name, CheckpointTensor.lazy(name, shape, read_slices, dtype, blocks)


def _quantized_blocks(tensor: MappedTensor, config: PretrainedConfig, arch: str, name: str) -> QuantizedBlocks | None:
    """The blocks of a 2-D tensor in a quantized type (None for F32/F16/BF16), read from the file's memory map."""
    if tensor.tensor_type in FLOAT_TYPES:
        return None
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    data = tensor.data  # uint8 [rows, row bytes]
    order = torch.arange(data.shape[0])
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # the rows unpermuted, as _dense does
        num_heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        order = unpermute_rotary(order, num_heads)

    def read_rows(rows: slice) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(data[order[rows].numpy()]))

    return QuantizedBlocks(tensor.tensor_type.name, block_size, block_bytes, read_rows)


def hf_name(gguf_name: str, path: Path | str = "<gguf>") -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; 'output.weight' -> 'lm_head.weight'."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"{path} holds a tensor {gguf_name!r} that this loader cannot map to a Hugging Face name")


def _dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from error
    # GGUF lists dimensions fastest-varying first; torch wants them slowest first
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    # F32 tensors come back as read-only views of the file's memory map: copy those, not fresh dequantized arrays
    return np.require(values, np.float32, ["C", "W"]).reshape(shape)


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Llama q/k rows (of a weight or a bias).

    Within each head, Hugging Face's rotary pairs dimension i with i + head_dim/2; llama.cpp converts the rows to
    interleaved pairs (2i, 2i+1). Its rows are laid out [head, i, pair_member]; ours are [head, pair_member, i].
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


# ---- tokenizer -------------------------------------------------------------------------------------------------


def _build_tokenizer(reader: gguf.GGUFReader, path: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer conversion (BPE/sentencepiece, special tokens, add_bos_token)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"{path}: transformers cannot build a tokenizer from its metadata: {error}") from error
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _field(reader, "tokenizer.chat_template")
    return tokenizer


# ---- cache -----------------------------------------------------------------------------------------------------
# An entry is a directory <content hash>-<dtype> holding config.json, the tokenizer files and model.safetensors (the
# float conversion, for an engine that does not keep the weights quantized), or <content hash>-tokenizer holding the
# tokenizer files alone. It is written under a temporary name and renamed into place, so a directory with the final
# name is complete.


def _cache_key(path: Path, kind: torch.dtype | str) -> str:
    """<content hash>-<dtype> for a converted checkpoint, <content hash>-tokenizer or -index for the others."""
    kind = kind if isinstance(kind, str) else str(kind).removeprefix("torch.")
    return f"{_content_hash(path.resolve(), path.stat().st_mtime_ns, path.stat().st_size)}-{kind}"


@functools.lru_cache(maxsize=16)
def _content_hash(path: Path, mtime_ns: int, size: int) -> str:
    """Once per file version in a process (hashing SmolLM2's 98 MB takes ~0.3 s)."""
    digest = hashlib.sha256(f"pagedllm-gguf-v{CACHE_FORMAT_VERSION}".encode())
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def _write_cache(checkpoint: GGUFCheckpoint, entry: Path) -> None:
    def write(staging: Path) -> None:
        checkpoint.config.save_pretrained(staging)
        checkpoint.tokenizer.save_pretrained(staging)
        save_file(checkpoint.tensors, staging / "model.safetensors")

    _write_entry(entry, write)


def _write_entry(entry: Path, write) -> None:
    """write(staging directory), then the directory renamed into place as `entry`."""
    staging = entry.with_name(f".{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        staging.mkdir(parents=True)
        write(staging)
        staging.rename(entry)
    except OSError as error:  # read-only or full disk, or another process renamed its copy first: loading still works
        warnings.warn(f"could not cache the converted GGUF at {entry}: {error}", stacklevel=4)
        shutil.rmtree(staging, ignore_errors=True)


def _read_cache(entry: Path) -> GGUFCheckpoint:
    config = AutoConfig.from_pretrained(entry)
    tokenizer = AutoTokenizer.from_pretrained(entry)
    return GGUFCheckpoint(config, load_file(entry / "model.safetensors"), tokenizer)
