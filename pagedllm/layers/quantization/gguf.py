"""GGUF block formats kept quantized on CPU: each supported block decodes to 4-bit values in groups of 32 with a scale
and a zero each, weight = (value - 8) x scale + zero, the form torch's `_weight_int4pack_mm_for_cpu` multiplies by
(benchmarks/NOTES.md, "GGUF weights on CPU", for the candidates measured).

- Q4_0, Q4_1 and Q4_K are that form exactly (Q4_K's 6-bit sub-block scales and minimums become the group's).
- Q8_0, Q5_0, Q5_1 and Q5_K split each value in a high and a low part, two 4-bit halves whose weights add up to the
  block's: the weight has twice the columns [high | low] and multiplies [x, x].
- Any other type (Q6_K, Q2_K, IQ*...), or a layer mixing one with these, is dequantized to the model's dtype.

Every product goes through the int4 kernel, in bfloat16 (its only vectorised path: float32 activations are cast to
it and back). Its rows are computed independently (the same bits for a row whatever the others), so greedy output
does not change with batch composition, chunking or prefix caching; a float GEMM for large steps (prompts) would be
~2.5x faster there but would change a row's result with the step's size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear_method import UnquantizedLinearMethod
from pagedllm.loader.checkpoint_tensor import CheckpointTensor

GROUP = 32  # values per scale and zero, the kernel's smallest group
KERNEL_DTYPE = torch.bfloat16
ROW_BLOCK = 64  # rows are padded to a multiple of this (the kernel packs 64 output rows at a time)


@dataclass(slots=True)
class Int4Groups:
    """values uint8 [N, C] in 0..15; scales and zeros float32 [N, C / GROUP]: weight[:, c] = (values - 8) x scale
    + zero. With halves, C = 2 K and the layer's weight is the sum of columns [:K] and [K:]."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    halves: bool

    def as_halves(self) -> Int4Groups:
        """The same weight with a second half of zeros (value 8, scale 0, zero 0), to sit beside halved parts."""
        if self.halves:
            return self
        return Int4Groups(
            torch.cat([self.values, torch.full_like(self.values, 8)], 1),
            torch.cat([self.scales, torch.zeros_like(self.scales)], 1),
            torch.cat([self.zeros, torch.zeros_like(self.zeros)], 1),
            True,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these groups stand for."""
        rows, columns = self.values.shape
        grouped = (self.values.view(rows, -1, GROUP).float() - 8) * self.scales[..., None] + self.zeros[..., None]
        weight = grouped.view(rows, columns)
        return weight[:, : columns // 2] + weight[:, columns // 2 :] if self.halves else weight


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


def groups(values, scales, zeros, high=None, high_scales=None, high_zeros=None) -> Int4Groups:
    """From [rows, groups, 32] values and [rows, groups, 1] scales and zeros (and a high half likewise)."""
    rows = values.shape[0]

    def flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(rows, -1)

    if high is None:
        return Int4Groups(flat(values), flat(scales), flat(zeros), halves=False)
    return Int4Groups(
        torch.cat([flat(high), flat(values)], 1),
        torch.cat([flat(high_scales), flat(scales)], 1),
        torch.cat([flat(high_zeros), flat(zeros)], 1),
        halves=True,
    )


def decode_q4_0(blocks: torch.Tensor) -> Int4Groups:  # d (f16), 16 bytes of nibbles: d (q - 8)
    d = half_float(blocks, 0)
    return groups(nibbles(blocks[..., 2:18]), d, torch.zeros_like(d))


def decode_q4_1(blocks: torch.Tensor) -> Int4Groups:  # d, m (f16), 16 bytes of nibbles: d q + m
    d, m = half_float(blocks, 0), half_float(blocks, 2)
    return groups(nibbles(blocks[..., 4:20]), d, m + 8 * d)


def decode_q8_0(blocks: torch.Tensor) -> Int4Groups:  # d (f16), 32 int8: d q, q = 16 (high - 8) + low
    d = half_float(blocks, 0)
    q = blocks[..., 2:34].contiguous().view(torch.int8)
    high, low = ((q >> 4) + 8).to(torch.uint8), (q & 15).to(torch.uint8)
    return groups(low, d, 8 * d, high, 16 * d, torch.zeros_like(d))


def decode_q5(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, start: int) -> Int4Groups:
    """Q5_0 (d (q - 16)) and Q5_1 (d q + m): 4 bytes of high bits, then 16 bytes of low nibbles, from `start`."""
    high = bits(blocks[..., start : start + 4], 32)
    low = nibbles(blocks[..., start + 4 : start + 20])
    offset = -16 * d if m is None else m  # weight = 16 d high + d low + offset
    return groups(low, d, 8 * d + offset, high, 16 * d, 128 * d)


def decode_q5_0(blocks: torch.Tensor) -> Int4Groups:
    return decode_q5(blocks, half_float(blocks, 0), None, 2)


def decode_q5_1(blocks: torch.Tensor) -> Int4Groups:
    return decode_q5(blocks, half_float(blocks, 0), half_float(blocks, 2), 4)


def k_quant_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks: d, dmin (f16) and 12 bytes of 6-bit scales and minimums for 8 sub-blocks of 32;
    a sub-block's weight is d sc q - dmin m. Returns (d sc, dmin m), [rows, blocks x 8, 1]."""
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


def decode_q4_k(blocks: torch.Tensor) -> Int4Groups:
    scale, minimum = k_quant_scales(blocks)
    return groups(k_quant_nibbles(blocks[..., 16:144]), scale, 8 * scale - minimum)


def decode_q5_k(blocks: torch.Tensor) -> Int4Groups:  # 32 bytes of high bits (bit j: sub-block j), then nibbles
    rows, count = blocks.shape[:2]
    scale, minimum = k_quant_scales(blocks)
    high_bits = blocks[..., 16:48].reshape(rows, count, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
    high = (high_bits & 1).reshape(rows, count * 8, 32)
    return groups(k_quant_nibbles(blocks[..., 48:176]), scale, 8 * scale - minimum, high, 16 * scale, 128 * scale)


DECODERS = {
    "Q4_0": decode_q4_0,
    "Q4_1": decode_q4_1,
    "Q8_0": decode_q8_0,
    "Q5_0": decode_q5_0,
    "Q5_1": decode_q5_1,
    "Q4_K": decode_q4_k,
    "Q5_K": decode_q5_k,
}


def decode(loaded: CheckpointTensor) -> Int4Groups | None:
    """The part of the checkpoint tensor as int4 groups, or None: not in a supported block format, or cut off its
    blocks (a tensor-parallel shard across a block)."""
    if loaded.blocks is None or loaded.blocks.format not in DECODERS:
        return None
    raw = loaded.read_blocks()
    if raw is None:
        return None
    blocks = raw.view(raw.shape[0], -1, loaded.blocks.block_bytes)
    return DECODERS[loaded.blocks.format](blocks)


def pack(weight: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's packed values, its scales and zeros [C / GROUP, N', 2] in KERNEL_DTYPE), rows padded with zero
    weights to a multiple of ROW_BLOCK (N')."""
    rows = weight.values.shape[0]
    extra = -rows % ROW_BLOCK
    values = torch.cat([weight.values, torch.full((extra, weight.values.shape[1]), 8, dtype=torch.uint8)])
    scales = torch.cat([weight.scales, torch.zeros(extra, weight.scales.shape[1])])
    zeros = torch.cat([weight.zeros, torch.zeros(extra, weight.zeros.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    return packed, torch.stack([scales.t(), zeros.t()], -1).to(KERNEL_DTYPE).contiguous()


class GGUFLinearMethod(UnquantizedLinearMethod):
    """A linear layer whose weight stays in GGUF blocks, as int4 groups (above). Each part of the weight (a shard of
    a packed qkv or gate_up layer, or the whole) is decoded as it loads; `finish_loading` packs the parts for the
    kernel when every part decoded, else dequantizes the decoded parts into the float weight the unquantized method
    multiplies by (`format` says which, for the start-up log)."""

    def __init__(self, onednn: bool = False):
        super().__init__(onednn=onednn)
        self.parts: list[tuple[torch.Tensor, Int4Groups]] = []  # (the view of the weight it fills, its groups)
        self.formats: set[str] = set()  # the block formats (or dtypes) its parts were stored in
        self.quantized = False

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
        halves = any(part.halves for _, part in self.parts)
        self.parts.sort(key=lambda entry: entry[0].storage_offset())  # in row order
        parts = [part.as_halves() if halves else part for _, part in self.parts]
        merged = Int4Groups(
            torch.cat([part.values for part in parts]),
            torch.cat([part.scales for part in parts]),
            torch.cat([part.zeros for part in parts]),
            halves,
        )
        packed, scales_and_zeros = pack(merged)
        self.out_features, self.halves, self.quantized = weight.shape[0], halves, True
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.weight_scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)
        self.parts = []

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.quantized:
            return super().apply(layer, x, bias)
        activations = x.to(KERNEL_DTYPE)
        if self.halves:
            activations = torch.cat([activations, activations], 1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            activations, layer.weight, GROUP, layer.weight_scales_and_zeros
        )
        out = out[:, : self.out_features].to(x.dtype)
        return out if bias is None else out + bias

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


def packed_rows(packed: torch.Tensor, rows: torch.Tensor, tile_rows: int | None = None) -> torch.Tensor:
    """Values uint8 [len(rows), C] of some rows of the kernel's packing ([N', C / 2] bytes): each tile of B rows
    (B = packing_tile_rows() unless given) is stored as [C, B / 2] bytes, row r's value in the low nibble, row
    r + B / 2's in the high one (torch 2.13's layout; GGUFVocabMethod checks it against the values it packed and
    keeps float weights if it differs)."""
    tile_rows = tile_rows or packing_tile_rows()
    tiles = packed.view(packed.shape[0] // tile_rows, packed.shape[1] * 2, tile_rows // 2)
    lane = rows % tile_rows
    picked = tiles[rows // tile_rows, :, lane % (tile_rows // 2)]  # [len(rows), C]
    return (picked >> (4 * (lane >= tile_rows // 2)).to(torch.uint8)[:, None]) & 15


@functools.cache
def packing_tile_rows() -> int:
    """Rows per tile of torch's int4 packing on this CPU: 64 with AVX-512, 32 with AVX2 (found by packing a probe
    whose first column tells the rows of a tile apart); both divide ROW_BLOCK."""
    probe = torch.zeros(ROW_BLOCK * 2, GROUP, dtype=torch.int32)
    probe[:, 0] = torch.arange(ROW_BLOCK * 2) % 16
    probe[:, 1] = torch.arange(ROW_BLOCK * 2) // 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    rows = torch.arange(len(probe))
    for tile_rows in (ROW_BLOCK, ROW_BLOCK // 2):
        if torch.equal(packed_rows(packed, rows, tile_rows), probe.to(torch.uint8)):
            return tile_rows
    return ROW_BLOCK  # an unknown layout: GGUFVocabMethod's check then keeps the float weights


class GGUFVocabMethod:
    """The token embedding / LM head's [vocab, hidden] weight kept in GGUF blocks (SmolLM2's is Q8_0, tied): the
    LM head multiplies through the int4 kernel, as GGUFLinearMethod does, and the embedding dequantizes the rows it
    looks up from the same packing. A tied head shares its embedding's method. Holds the packing itself (the float
    `weight` parameter is emptied), or nothing when the blocks are not in a kept format (then `quantized` is
    False and the layer uses its float weight)."""

    def __init__(self):
        self.quantized = False
        self.format = "float"

    def load(self, param: torch.Tensor, loaded: CheckpointTensor) -> bool:
        """Decode and pack `loaded` (the whole vocabulary, one rank); False, touching nothing, if it cannot."""
        self.format = loaded.blocks.format if loaded.blocks is not None else "float"
        decoded = decode(loaded)
        if decoded is None or tuple(param.shape) != tuple(loaded.shape):
            return False
        packed, scales_and_zeros = pack(decoded)
        sample = torch.tensor([0, 1, 33, param.shape[0] - 1])
        if not torch.equal(packed_rows(packed, sample), decoded.values[sample]):  # a torch with another layout
            return False
        self.packed, self.scales_and_zeros, self.halves = packed, scales_and_zeros, decoded.halves
        self.vocab_rows, self.quantized = param.shape[0], True
        param.data = torch.empty(0, param.shape[1], dtype=param.dtype)  # shared with a tied head: emptied for both
        return True

    def finish_loading(self, layer: nn.Module) -> None:
        """Packed as it loaded."""

    def embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = packed_rows(self.packed, input_ids.flatten())
        scales = self.scales_and_zeros[:, input_ids.flatten()].to(dtype)  # [C / GROUP, rows, 2]
        rows, columns = values.shape
        grouped = (values.view(rows, -1, GROUP).to(dtype) - 8) * scales[..., 0].t()[..., None]
        weight = (grouped + scales[..., 1].t()[..., None]).view(rows, columns)
        if self.halves:
            weight = weight[:, : columns // 2] + weight[:, columns // 2 :]
        return weight.view(*input_ids.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        activations = hidden.to(KERNEL_DTYPE)
        if self.halves:
            activations = torch.cat([activations, activations], 1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(activations, self.packed, GROUP, self.scales_and_zeros)
        return out[:, : self.vocab_rows].to(hidden.dtype)
