"""Open a model by path: a Hugging Face directory or a GGUF file (None: the embedded default model).

Whatever the format, the engine gets a transformers config, a tokenizer, and (name, CheckpointTensor) pairs with
Hugging Face parameter names, read lazily so that each tensor-parallel rank reads only its shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedllm.loader.checkpoint_tensor import CheckpointTensor
from pagedllm.loader.fp8_checkpoint import fp8_format, iterate_fp8_safetensors
from pagedllm.loader.safetensors_loader import iterate_safetensors


@dataclass
class Checkpoint:
    source: str
    hf_config: object
    tokenizer: object
    # dtype -> (name, tensor) pairs that read in that dtype
    named_tensors: Callable[[torch.dtype], Iterable[tuple[str, CheckpointTensor]]]
    checkpoint_dtype: object = None
    generation_config: object = None  # generation_config.json, where the model has one (extra eos ids)
    # "fp8": an FP8 checkpoint (read dequantized; the engine may keep fp8 weights on a GPU); "gguf": GGUF blocks (read
    # as blocks by a method that keeps them quantized, else dequantized); None: 16- or 32-bit weights
    weights_format: str | None = None


def open_checkpoint(
    model: str | os.PathLike | None,
    tokenizer: str | os.PathLike | None = None,
    load_tokenizer: bool = True,
    write_cache: bool = True,
    gguf_file: str | None = None,
) -> Checkpoint:
    """`tokenizer`: a local tokenizer directory that replaces the model's own (never a hub id).
    write_cache: a GGUF file's tokenizer conversion is cached on disk (the engine's rank 0 does this); its weights
    are read from the file (`dequantized_gguf` for the float32 conversion).
    gguf_file: the .gguf file to load from a directory or hub repository that holds several (model_path)."""
    if tokenizer is not None:
        tokenizer = str(Path(tokenizer).expanduser())
    path = model_path(model, gguf_file)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path, tokenizer, load_tokenizer, write_cache)
    if path.is_dir() and (path / "config.json").exists():
        return open_hf_directory(path, tokenizer, load_tokenizer)
    if path.is_dir():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    raise ValueError(
        f"model {model!r} is neither a Hugging Face model directory nor a .gguf file, nor a hub id (org/name); pass "
        "one of those, or no model to use the embedded SmolLM2-135M-Instruct"
    )


def model_path(model: str | os.PathLike | None, gguf_file: str | None = None) -> Path:
    """Where the model is: None, the embedded default model; a local path; else a hub id, through the Hugging Face
    cache. A directory or repository without config.json but with .gguf files gives its one .gguf file, or with
    several the one `gguf_file` names (which also picks a .gguf file beside a config.json)."""
    if model is None:
        from pagedllm.loader.default_model import default_model_path

        model = str(default_model_path())
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(str(model)):
        return hub_model_path(str(model), gguf_file)
    if path.is_dir() and (gguf_file is not None or not (path / "config.json").exists()):
        names = sorted(str(file.relative_to(path)) for file in path.rglob("*.gguf"))
        name = pick_gguf(names, gguf_file, f"model directory {str(path)!r}")
        return path / name if name is not None else path
    if gguf_file is not None:
        raise ValueError(
            f"gguf_file={gguf_file!r} picks a .gguf file of a directory or hub repository, but model {str(model)!r} "
            "is not one; pass the .gguf file's path as the model instead"
        )
    return path


def pick_gguf(names: list[str], gguf_file: str | None, where: str) -> str | None:
    """The .gguf file of `where` to load: `gguf_file`, which must be one of `names`; else the only one; None where
    there is none."""
    if gguf_file is not None:
        if gguf_file not in names:
            raise ValueError(
                f"gguf_file={gguf_file!r} is not in {where}; its .gguf files: {', '.join(names) or 'none'}"
            )
        return gguf_file
    if len(names) > 1:
        raise ValueError(f"{where} holds {len(names)} .gguf files ({', '.join(names)}); pick one with gguf_file=NAME")
    return names[0] if names else None


# The files a model needs: config, weights, tokenizer and chat template (no .bin / .pth / .gguf copies of the weights)
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_hub_id(name: str) -> bool:
    """'org/name' as the Hugging Face hub spells repository ids (a local path that does not exist looks the same:
    the hub is asked only when no such path exists)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not name.endswith(".gguf")


def hub_model_path(repo_id: str, gguf_file: str | None) -> Path:
    """The repository's snapshot in the Hugging Face cache (downloaded where the hub is reachable; from the cache
    alone with HF_HUB_OFFLINE=1 or without network), or the .gguf file of a GGUF repository (model_path)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
        if gguf_file is None and (snapshot / "config.json").exists():
            return snapshot
        name = pick_gguf(hub_gguf_files(repo_id, snapshot), gguf_file, f"model {repo_id!r}")
        if name is None:
            raise ValueError(f"model {repo_id!r} has neither a config.json nor a .gguf file")
        return Path(hf_hub_download(repo_id, name))
    except LocalEntryNotFoundError:
        download = repo_id if gguf_file is None else f"{repo_id} {gguf_file}"
        raise ValueError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached (offline, or "
            f"HF_HUB_OFFLINE=1): run `hf download {download}` where the network is, or pass a local path"
        ) from None
    except HfHubHTTPError as error:  # no such repository, a gated one without a token...
        raise ValueError(f"model {repo_id!r}: the Hugging Face hub refused it: {error}") from None


def hub_gguf_files(repo_id: str, snapshot: Path) -> list[str]:
    """The repository's .gguf files: as the hub lists them, or where it cannot be asked (offline, unreachable), the
    ones the cached snapshot holds."""
    from huggingface_hub import list_repo_files

    try:
        names = list_repo_files(repo_id, revision=snapshot.name)
    except Exception:  # offline or unreachable, whichever exception the HTTP client raises: the cache then
        names = [str(file.relative_to(snapshot)) for file in snapshot.rglob("*.gguf")]
    return sorted(name for name in names if name.endswith(".gguf"))


def open_hf_directory(path: Path, tokenizer: str | None, load_tokenizer: bool) -> Checkpoint:
    hf_config = AutoConfig.from_pretrained(path)
    fp8 = fp8_format(hf_config)
    return Checkpoint(
        source=str(path),
        hf_config=hf_config,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer or path) if load_tokenizer else None,
        named_tensors=(
            (lambda dtype: iterate_safetensors(path, dtype))
            if fp8 is None
            else (lambda dtype: iterate_fp8_safetensors(path, dtype, fp8))
        ),
        # transformers 5 names it dtype (and warns on torch_dtype), 4.x torch_dtype
        checkpoint_dtype=getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None),
        generation_config=(
            GenerationConfig.from_pretrained(path) if (path / "generation_config.json").exists() else None
        ),
        weights_format=None if fp8 is None else "fp8",
    )


def open_gguf(path: Path, tokenizer: str | None, load_tokenizer: bool, write_cache: bool) -> Checkpoint:
    """Tensors read from the file when asked for: in quantized blocks for a linear method that keeps them, else
    dequantized (`dequantized_gguf` reads its float32 conversion cached on disk instead). write_cache: the tokenizer's
    conversion is cached (the engine's rank 0 does this)."""
    from pagedllm.loader.gguf_loader import build_tokenizer, gguf_index, lazy_gguf_tensors

    index = gguf_index(path, write_cache)
    if not load_tokenizer:
        tokenizer_object = None
    else:
        tokenizer_object = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else build_tokenizer(path, write_cache)
    return Checkpoint(
        source=str(path),
        hf_config=index.config,
        tokenizer=tokenizer_object,
        named_tensors=lambda dtype: lazy_gguf_tensors(path, index, dtype),
        weights_format="gguf",
    )


def dequantized_gguf(checkpoint: Checkpoint, write_cache: bool) -> Checkpoint:
    """A GGUF checkpoint whose weights are not kept quantized: its tensors from the float32 conversion cached on disk,
    converted and cached now with `write_cache` (the engine's rank 0 does this); without an entry, dequantized from
    the file when read."""
    from pagedllm.loader.gguf_loader import converted_copy

    converted = converted_copy(Path(checkpoint.source), write=write_cache)
    if converted is None:
        return checkpoint
    return replace(checkpoint, named_tensors=lambda dtype: iterate_safetensors(converted, dtype))
