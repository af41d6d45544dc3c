"""Tiny FP8 checkpoints for tests: a tiny checkpoint's projections quantized to float8 e4m3 with block, per-row or
per-tensor scales, written as the Hugging Face `quant_method: fp8` format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm.loader.fp8_checkpoint import block_scales_for

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(weight: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, scales) of a float32 weight under one of the checkpoint formats."""
    rows, cols = weight.shape
    if scheme == "tensor":
        scales = weight.abs().amax() / FP8_MAX
        return (weight / scales).to(torch.float8_e4m3fn), scales.reshape(1)
    if scheme == "row":
        scales = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return (weight / scales).to(torch.float8_e4m3fn), scales
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scales[i, j] = part.abs().amax() / FP8_MAX
    full = slice(0, rows), slice(0, cols)
    return (weight / block_scales_for(scales, *full, block)).to(torch.float8_e4m3fn), scales


def write_fp8_checkpoint(source: Path, target: Path, scheme: str, block=(32, 48)) -> None:
    """The tiny checkpoint in `source` with its projections in fp8; `source` is rewritten with the dequantized
    weights, the reference both engines load."""
    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            values, scales = quantize(tensor, scheme, block)
            suffix = "_scale_inv" if scheme == "block" else "_scale"
            quantized[name], quantized[name + suffix] = values, scales
            if scheme == "block":
                expanded = block_scales_for(scales, slice(0, tensor.shape[0]), slice(0, tensor.shape[1]), block)
            else:
                expanded = scales.reshape(-1, 1) if scales.numel() > 1 else scales.reshape(())
            dequantized[name] = values.to(torch.float32) * expanded
            if name.endswith("q_proj.weight"):  # a static activation scale, as some checkpoints carry: unused
                quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)
        else:
            quantized[name] = dequantized[name] = tensor
    target.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        config["quantization_config"]["weight_block_size"] = list(block)
    (target / "config.json").write_text(json.dumps(config))
    save_file(quantized, target / "model.safetensors")
    save_file(dequantized, source / "model.safetensors", metadata={"format": "pt"})
