"""GGUF block formats kept quantized on CPU: each supported block decodes to small integers in groups of 32 with a
scale and an offset each, weight = value x scale + offset, the form cpu_grouped_gemm.py multiplies by.

- Q4_0, Q4_1 and Q4_K keep 4-bit values (0..15; Q4_K's 6-bit sub-block scales and minimums become the group's).
- Q8_0, Q5_0, Q5_1 and Q5_K keep 8-bit ones (Q8_0's signed bytes; the 5-bit values 0..31).
- Any other type (Q6_K, Q2_K, IQ*...), or a layer mixing one with these, is dequantized to the model's dtype, and so
  is every layer where the kernel cannot be built (kernel_selection decides, with one log line).

The kernel rounds each row of activations to int16 per group of 32 (products within ~2e-5 of float32's) and
computes every row the same way whatever the others (the same bits for a row whatever the step), so a decoding row's
output does not change with batch composition or speculation. A step's prompt-chunk rows multiply the weight
dequantized to float32 instead (GGUFLinearMethod), whose bits, as with float weights, follow the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu_kernels import require
from pagedllm.layers.casts import cast
from pagedllm.layers.linear_method import UnquantizedLinearMethod
from pagedllm.layers.quantization.cpu_grouped_gemm import GROUP, dequantize, grouped_mm
from pagedllm.layers.step_rows import prompt_rows
from pagedllm.loader.checkpoint_tensor import CheckpointTensor


@dataclass(slots=True)
class IntGroups:
    """values [N, K]: uint8 0..15 (bits 4) or int8 (bits 8); scales and offsets float32 [N, K / GROUP]:
    weight[:, k] = values[:, k] x scales[:, k / GROUP] + offsets[:, k / GROUP]."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int

    def widened(self) -> IntGroups:
        """The same weight with 8-bit values, to sit beside 8-bit parts."""
        return self if self.bits == 8 else IntGroups(self.values.to(torch.int8), self.scales, self.offsets, 8)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these groups stand for."""
        rows, columns = self.values.shape
        grouped = self.values.view(rows, -1, GROUP).float() * self.scales[..., None] + self.offsets[..., None]
        return grouped.view(rows, columns)


def half_float(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of each block, as float32 [rows, blocks, 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2 n] values: the low nibbles of the n bytes, then their high nibbles (ggml's order)."""
    return torch.cat([packed & 15, packed >> 4], -1)


def bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bits: [..., n] bytes -> [..., count] values in 0..1, bit i of the run being value i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed[..., :, None] >> shifts) & 1).flatten(-2)[..., :count]


def groups(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> IntGroups:
    """From [rows, groups, 32] values and [rows, groups, 1] scales and offsets."""
    rows = values.shape[0]
    return IntGroups(values.reshape(rows, -1), scales.reshape(rows, -1), offsets.reshape(rows, -1), bits)


def decode_q4_0(blocks: torch.Tensor) -> IntGroups:  # d (f16), 16 bytes of nibbles: d (q - 8)
    d = half_float(blocks, 0)
    return groups(nibbles(blocks[..., 2:18]), d, -8 * d, 4)


def decode_q4_1(blocks: torch.Tensor) -> IntGroups:  # d, m (f16), 16 bytes of nibbles: d q + m
    return groups(nibbles(blocks[..., 4:20]), half_float(blocks, 0), half_float(blocks, 2), 4)


def decode_q8_0(blocks: torch.Tensor) -> IntGroups:  # d (f16), 32 int8: d q
    d = half_float(blocks, 0)
    return groups(blocks[..., 2:34].contiguous().view(torch.int8), d, torch.zeros_like(d), 8)


def decode_q5(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, start: int) -> IntGroups:
    """Q5_0 (d (q - 16)) and Q5_1 (d q + m): 4 bytes of high bits, then 16 bytes of low nibbles, from `start`."""
    high = bits(blocks[..., start : start + 4], 32)
    low = nibbles(blocks[..., start + 4 : start + 20])
    values = (16 * high + low).view(torch.int8)
    return groups(values, d, -16 * d if m is None else m, 8)


def decode_q5_0(blocks: torch.Tensor) -> IntGroups:
    return decode_q5(blocks, half_float(blocks, 0), None, 2)


def decode_q5_1(blocks: torch.Tensor) -> IntGroups:
    return decode_q5(blocks, half_float(blocks, 0), half_float(blocks, 2), 4)


def k_quant_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks: d, dmin (f16) and 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32;
    a sub-block's weight is d sc q - dmin m. Returns (d sc, dmin m), [rows, blocks x 8, 1]."""
    import gguf  # here, not at import: the engine runs without the gguf package until a GGUF file is loaded

    rows, count = blocks.shape[:2]
    packed = blocks[..., 4:16].reshape(-1, 12).numpy()
    sc, m = gguf.quants.Q4_K.get_scale_min(packed)
    sc = torch.from_numpy(sc.astype(np.float32)).view(rows, count, 8)
    m = torch.from_numpy(m.astype(np.float32)).view(rows, count, 8)
    return (half_float(blocks, 0) * sc).view(rows, -1, 1), (half_float(blocks, 2) * m).view(rows, -1, 1)


def k_quant_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """128 bytes -> the 8 sub-blocks' 4-bit values: each 32 bytes hold two sub-blocks, low nibbles first."""
    rows, count = packed.shape[:2]
    return nibbles(packed.reshape(rows, count, 4, 32)).reshape(rows, count * 8, 32)


def decode_q4_k(blocks: torch.Tensor) -> IntGroups:
    scale, minimum = k_quant_scales(blocks)
    return groups(k_quant_nibbles(blocks[..., 16:144]), scale, -minimum, 4)


def decode_q5_k(blocks: torch.Tensor) -> IntGroups:  # 32 bytes of high bits (bit j: sub-block j), then nibbles
    rows, count = blocks.shape[:2]
    scale, minimum = k_quant_scales(blocks)
    high_bits = blocks[..., 16:48].reshape(rows, count, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
    high = (high_bits & 1).reshape(rows, count * 8, 32)
    values = (16 * high + k_quant_nibbles(blocks[..., 48:176])).view(torch.int8)
    return groups(values, scale, -minimum, 8)


DECODERS = {
    "Q4_0": decode_q4_0,
    "Q4_1": decode_q4_1,
    "Q8_0": decode_q8_0,
    "Q5_0": decode_q5_0,
    "Q5_1": decode_q5_1,
    "Q4_K": decode_q4_k,
    "Q5_K": decode_q5_k,
}


def decode(loaded: CheckpointTensor) -> IntGroups | None:
    """The part of the checkpoint tensor as integer groups, or None: not in a supported block format, or cut off
    its blocks (a tensor-parallel shard across a block)."""
    if loaded.blocks is None or loaded.blocks.format not in DECODERS:
        return None
    raw = loaded.read_blocks()
    if raw is None:
        return None
    blocks = raw.view(raw.shape[0], -1, loaded.blocks.block_bytes)
    return DECODERS[loaded.blocks.format](blocks)


@dataclass(slots=True)
class PackedGroups:
    """The kernel's operands: values as bytes [N, K x bits / 8] (4 bits: byte j of a group holds value j low and
    value j + 16 high), scales float32 [N, 2, K / GROUP] (scales, then offsets)."""

    values: torch.Tensor
    scales: torch.Tensor
    bits: int

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x W^T, float32 [M, N]."""
        return grouped_mm(cast(x, torch.float32).contiguous(), self.values, self.scales, self.bits)

    def multiply_in_float(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T as multiply's, with W dequantized to float32 for this product (a GEMM: at a prompt's hundreds of rows
        1.7x the grouped kernel's rate; the dequantization, ~0.4 ms a layer of the default model, is paid each call)."""
        return F.linear(cast(x, torch.float32), dequantize(self.values, self.scales, self.bits))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows `ids` (1-D), dequantized to `dtype`: [len(ids), K]."""
        picked = self.values[ids]
        if self.bits == 4:
            picked = nibbles(picked.view(len(ids), -1, GROUP // 2))
        else:
            picked = picked.view(torch.int8).view(len(ids), -1, GROUP)
        scales = self.scales[ids].to(dtype)  # [len(ids), 2, K / GROUP]
        grouped = picked.to(dtype) * scales[:, 0, :, None] + scales[:, 1, :, None]
        return grouped.view(len(ids), -1)


def pack(weight: IntGroups) -> PackedGroups:
    require()
    rows = weight.values.shape[0]
    values = weight.values
    if weight.bits == 4:
        grouped = values.view(rows, -1, 2, GROUP // 2)
        values = (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(rows, -1)
    else:
        values = values.view(torch.uint8)
    return PackedGroups(values.contiguous(), torch.stack([weight.scales, weight.offsets], 1).contiguous(), weight.bits)


class GGUFLinearMethod(UnquantizedLinearMethod):
    """A linear layer whose weight stays in GGUF blocks, as integer groups (above). Each part of the weight (a shard
    of a packed qkv or gate_up layer, or the whole) is decoded as it loads; `finish_loading` packs the parts for the
    kernel when every part decoded (4-bit parts widened to 8 bits beside an 8-bit one), else dequantizes the decoded
    parts into the float weight the unquantized method multiplies by (`describe` says which, for the start-up log).

    With `float_prompts` the rows of a step's prompt chunks (layers/step_rows.py) take the weight dequantized to
    float32 for each product, a GEMM (32 chats 1.13x, 64 sequences 1.26x faster end to end); the rows that decode
    (decode, verify) always take the grouped kernel, so a decoding row's bits still depend on that row alone. A prompt
    row's bits depend on its chunk's row count (the GEMM's blocking), as with float weights."""

    def __init__(self, linear: str = "torch", float_prompts: bool = False):
        super().__init__(linear)  # the product of a layer whose blocks are not kept (dequantized to float)
        self.float_prompts = float_prompts  # a step's prompt rows multiply the weight in float (class docstring)
        self.parts: list[tuple[torch.Tensor, IntGroups]] = []  # (the view of the weight it fills, its groups)
        self.formats: set[str] = set()  # the block formats (or dtypes) its parts were stored in
        self.packed: PackedGroups | None = None

    @property
    def quantized(self) -> bool:
        return self.packed is not None

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> None:
        decoded = decode(loaded) if param.dim() == 2 else None
        self.formats.add(loaded.blocks.format if loaded.blocks is not None else "float")
        if decoded is None or tuple(param.shape) != tuple(loaded.shape):
            super().load(param, loaded)
            return
        self.parts.append((param, decoded))

    def finish_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        covered = sum(view.shape[0] for view, _ in self.parts)
        if covered != weight.shape[0]:  # some part is not in a supported format: the whole layer in float
            for view, part in self.parts:
                view.copy_(part.dequantize())
            self.parts = []
            super().finish_loading(layer)
            return
        self.parts.sort(key=lambda entry: entry[0].storage_offset())  # in row order
        bits = max(part.bits for _, part in self.parts)
        parts = [part.widened() if bits == 8 else part for _, part in self.parts]
        merged = IntGroups(
            torch.cat([part.values for part in parts]),
            torch.cat([part.scales for part in parts]),
            torch.cat([part.offsets for part in parts]),
            bits,
        )
        self.packed = pack(merged)
        layer.weight = nn.Parameter(self.packed.values, requires_grad=False)  # what the layer holds, for its size
        self.parts = []

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None:
            return super().apply(layer, x, bias)
        rows = prompt_rows() if self.float_prompts else None
        if rows is None:
            out = self.packed.multiply(x)
        elif rows.decoding is None:
            out = self.packed.multiply_in_float(x)
        else:
            out = x.new_empty((x.shape[0], self.packed.values.shape[0]), dtype=torch.float32)
            out[rows.prompt] = self.packed.multiply_in_float(x[rows.prompt])
            out[rows.decoding] = self.packed.multiply(x[rows.decoding])
        out = cast(out, x.dtype)
        return out if bias is None else out + bias

    def cpu_product(self, layer: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
        if self.packed is None:
            return super().cpu_product(layer)
        return self.packed.bits, self.packed.values, self.packed.scales

    def describe(self) -> str:
        """'Q4_1' (kept quantized) or 'Q6_K dequantized' (kept in float), for the start-up log."""
        formats = "+".join(sorted(self.formats))
        return formats if self.quantized else f"{formats} dequantized"


def describe_formats(model: nn.Module) -> str:
    """How many linear layers hold each format, e.g. '210 linear layers kept quantized (Q4_1 x 180, Q8_0 x 30); 30
    dequantized, their types not kept (Q6_K x 30); vocabulary kept quantized (Q8_0)': the one start-up line that
    names every type this method does not keep."""
    kept: dict[str, int] = {}
    dequantized: dict[str, int] = {}
    vocabularies = []
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, GGUFLinearMethod):
            counts = kept if method.quantized else dequantized
            name = "+".join(sorted(method.formats))
            counts[name] = counts.get(name, 0) + 1
        elif isinstance(method, GGUFVocabMethod) and all(method is not seen for seen in vocabularies):
            vocabularies.append(method)  # a tied head shares its embedding's method: counted once

    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{name} x {count}" for name, count in sorted(counts.items()))

    line = f"{sum(kept.values())} linear layers kept quantized ({listed(kept) or 'none'})"
    if dequantized:
        line += f"; {sum(dequantized.values())} dequantized, their types not kept ({listed(dequantized)})"
    for method in vocabularies:
        line += f"; vocabulary {'kept quantized' if method.quantized else 'dequantized'} ({method.format})"
    return line


class GGUFVocabMethod:
    """The token embedding / LM head's [vocab, hidden] weight kept in GGUF blocks (SmolLM2's is Q8_0, tied): the
    LM head multiplies through the kernel, as GGUFLinearMethod does, and the embedding dequantizes the rows it looks
    up from the same packing. A tied head shares its embedding's method. Holds the packing itself (the float
    `weight` parameter is emptied), or nothing when the blocks are not in a kept format (then `quantized` is
    False and the layer uses its float weight)."""

    def __init__(self):
        self.packed: PackedGroups | None = None
        self.format = "float"

    @property
    def quantized(self) -> bool:
        return self.packed is not None

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> bool:
        """Decode and pack `loaded` (the whole vocabulary, one rank); False, touching nothing, if it cannot."""
        self.format = loaded.blocks.format if loaded.blocks is not None else "float"
        decoded = decode(loaded)
        if decoded is None or tuple(param.shape) != tuple(loaded.shape):
            return False
        self.packed = pack(decoded)
        param.data = torch.empty(0, param.shape[1], dtype=param.dtype)  # shared with a tied head: emptied for both
        return True

    def finish_loading(self, layer: nn.Module) -> None:
        """Packed as it loaded."""

    def embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.packed.rows(input_ids.flatten(), dtype).view(*input_ids.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(self.packed.multiply(hidden), hidden.dtype)
