"""A Hugging Face model directory: config.json and one or many *.safetensors (with or without the index file)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.loader.checkpoint_tensor import CheckpointTensor


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights found (other formats are not supported)")
    missing = [str(path) for path in files if not path.exists()]
    if missing:
        raise ValueError(f"{model_dir}: the index names files that do not exist: {', '.join(missing)}")
    return files


def open_safetensors(path: Path):
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:  # a truncated, empty or corrupt file fails on its header
        raise ValueError(f"{path} is not a readable .safetensors file (truncated or corrupt?): {error}") from None


def iterate_safetensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Lazily: read each tensor (the part of it that is needed) before asking for the next one, since a file is
    closed once all of its tensors have been yielded."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                yield name, CheckpointTensor.lazy(name, tuple(part.get_shape()), part.__getitem__, dtype)
