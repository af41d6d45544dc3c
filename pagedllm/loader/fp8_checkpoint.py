"""FP8 checkpoints (`quantization_config.quant_method == "fp8"`): float8 e4m3 weights with their scales, read as
dequantized tensors. A weight `W` is stored beside one of:

- `W_scale_inv` with `weight_block_size` [bn, bk]: one float32 scale per block of bn rows x bk columns, shape
  [ceil(N / bn), ceil(K / bk)] (the last blocks may be ragged); value = fp8 x scale.
- `W_scale`: one scale for the whole tensor (shape [] or [1]) or one per output row ([N] or [N, 1]).

Reading a part of `W` (a tensor-parallel shard) reads only that part and the scales that cover it. Static
activation scales (`input_scale`) are not used: activations are quantized per token, when they are at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.loader.checkpoint_tensor import CheckpointTensor
from pagedllm.loader.safetensors_loader import open_safetensors, safetensors_files

FP8_FILE_DTYPE = "F8_E4M3"  # safetensors' name for float8 e4m3
SCALE_SUFFIXES = ("_scale_inv", "_scale")
INPUT_SCALE_SUFFIX = ".input_scale"


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """What the checkpoint's quantization_config says about its weights."""

    block_size: tuple[int, int] | None  # [rows, columns] per scale; None: per-tensor or per-row scales


def fp8_format(hf_config) -> Fp8Format | None:
    """The checkpoint's FP8 format, None for an unquantized checkpoint; a ValueError for any other method."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization method {method!r} is not supported (supported: 'fp8' checkpoints)")
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block)):
        raise ValueError(f"fp8 checkpoint: weight_block_size must be two positive ints, got {block!r}")
    return Fp8Format(tuple(block) if block else None)


def block_scales_for(scales: torch.Tensor, rows: slice, cols: slice, block: tuple[int, int]) -> torch.Tensor:
    """Each element's scale over the part [rows, cols] of the weight, from the per-block scales."""
    block_rows = scales[rows.start // block[0] : -(-rows.stop // block[0])]
    block_cols = block_rows[:, cols.start // block[1] : -(-cols.stop // block[1])]
    expanded = block_cols.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    row_offset, col_offset = rows.start % block[0], cols.start % block[1]
    return expanded[row_offset : row_offset + rows.stop - rows.start, col_offset : col_offset + cols.stop - cols.start]


def dequantized_reader(weight_part, scales: torch.Tensor, block: tuple[int, int] | None):
    """A SliceReader returning value x scale, in float32, for the requested part of a 2-D fp8 weight."""

    def read(slices: tuple[slice, ...]) -> torch.Tensor:
        rows, cols = slices
        values = weight_part[rows, cols].to(torch.float32)
        if block is not None:
            return values * block_scales_for(scales, rows, cols, block)
        if scales.numel() == 1:  # per tensor
            return values * scales.reshape(())
        return values * scales.reshape(-1, 1)[rows]  # per row

    return read


def check_scale_shape(
    name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None
) -> None:
    rows, cols = weight_shape
    if block is not None:
        expected = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale_shape) != expected:
            raise ValueError(
                f"fp8 weight {name!r} of shape {weight_shape} with blocks {block} needs scales of shape "
                f"{expected}, got {tuple(scale_shape)}"
            )
    elif tuple(scale_shape) not in ((), (1,), (rows,), (rows, 1)):
        raise ValueError(
            f"fp8 weight {name!r} of shape {weight_shape}: a scale per tensor ([] or [1]) or per row ([{rows}] or "
            f"[{rows}, 1]) is needed, got {tuple(scale_shape)}"
        )


def iterate_fp8_safetensors(
    model_dir: Path, dtype: torch.dtype, fmt: Fp8Format
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint with Hugging Face names: fp8 weights dequantized when read (their scale
    tensors consumed with them), unquantized tensors (norms, embeddings) as they are. Every file stays open until
    the last tensor is yielded, since a weight and its scale may lie in different files."""
    with ExitStack() as stack:
        handles, parts = {}, {}
        for path in safetensors_files(model_dir):
            handle = stack.enter_context(open_safetensors(path))
            for name in handle.keys():
                handles[name], parts[name] = handle, handle.get_slice(name)
        consumed: set[str] = set()
        for name, part in parts.items():
            shape = tuple(part.get_shape())
            if part.get_dtype() != FP8_FILE_DTYPE:
                continue
            scale_name = next((name + suffix for suffix in SCALE_SUFFIXES if name + suffix in parts), None)
            if scale_name is None or len(shape) != 2:
                raise ValueError(f"fp8 checkpoint: weight {name!r} of shape {shape} needs a 2-D shape and a scale")
            scales = handles[scale_name].get_tensor(scale_name).to(torch.float32)  # small: read whole
            block = fmt.block_size if scale_name.endswith("_scale_inv") else None
            if block is None and scale_name.endswith("_scale_inv"):
                raise ValueError(f"fp8 checkpoint: {scale_name!r} holds block scales but weight_block_size is unset")
            check_scale_shape(name, shape, tuple(scales.shape), block)
            consumed.add(scale_name)
            parts[name] = CheckpointTensor.lazy(name, shape, dequantized_reader(part, scales, block), dtype)
        for name, part in parts.items():
            if name in consumed or name.endswith(INPUT_SCALE_SUFFIX):
                continue
            if isinstance(part, CheckpointTensor):
                yield name, part
            elif name.endswith(SCALE_SUFFIXES):
                raise ValueError(f"fp8 checkpoint: scale {name!r} belongs to no fp8 weight")
            else:
                yield name, CheckpointTensor.lazy(name, tuple(part.get_shape()), part.__getitem__, dtype)
