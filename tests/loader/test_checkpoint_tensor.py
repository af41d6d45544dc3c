"""CheckpointTensor: a weight narrowed to a rank's shard reads exactly that part of the file, from safetensors, from
a GGUF file (dequantized, Llama q/k rows unpermuted) and from the GGUF's cached conversion."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_gguf_loader import tiny_weights, write_tiny_gguf

from pagedllm.loader.checkpoint import dequantized_gguf, open_checkpoint
from pagedllm.loader.checkpoint_tensor import CheckpointTensor
from pagedllm.loader.gguf_loader import load_gguf
from pagedllm.loader.safetensors_loader import iterate_safetensors


def shards(tensor) -> list:
    """A few parts a rank could ask for: rows, columns, rows of columns, nothing."""
    rows = tensor.shape[0]
    parts = [tensor.narrow(0, 1, rows // 2), tensor.narrow(0, rows, 0)]
    if len(tensor.shape) == 2:
        columns = tensor.narrow(1, 2, tensor.shape[1] // 4)
        parts += [columns, columns.narrow(0, rows // 2, rows // 4)]
    return parts


def test_narrowing_reads_the_same_part_as_torch():
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    lazy = CheckpointTensor.lazy("w", tuple(full.shape), full.__getitem__, torch.bfloat16)
    for part, expected in zip(shards(lazy), shards(full), strict=True):
        assert part.shape == expected.shape
        assert part.read().dtype == torch.bfloat16 and torch.equal(part.read(), expected.to(torch.bfloat16))
    with pytest.raises(ValueError, match="'w' of shape \\(6, 8\\) has no range \\[4, 8\\) in dimension 0"):
        lazy.narrow(0, 4, 4)


def test_safetensors_parts(tmp_path):
    tensors = {"a.weight": torch.randn(6, 8), "a.bias": torch.randn(6)}
    save_file(tensors, tmp_path / "model.safetensors")
    for name, lazy in iterate_safetensors(tmp_path, torch.float64):
        assert lazy.shape == tensors[name].shape
        for part, expected in zip(shards(lazy), shards(tensors[name]), strict=True):
            assert torch.equal(part.read(), expected.double()), name


@pytest.mark.parametrize("convert", [False, True])
def test_gguf_parts_with_and_without_the_cached_conversion(tmp_path, monkeypatch, convert):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_weights("llama", 16, tied=False, bias=True), 16)
    expected = load_gguf(path, torch.float32, use_cache=False).tensors
    checkpoint = open_checkpoint(str(path), load_tokenizer=False, write_cache=False)
    if convert:
        checkpoint = dequantized_gguf(checkpoint, write_cache=True)
    assert (tmp_path / "cache").is_dir() == convert  # only rank 0 (write_cache) writes the cache
    loaded = dict(checkpoint.named_tensors(torch.float32))
    assert loaded.keys() == expected.keys()
    for name, lazy in loaded.items():
        for part, reference in zip(shards(lazy), shards(expected[name]), strict=True):
            assert torch.equal(part.read(), reference), name
