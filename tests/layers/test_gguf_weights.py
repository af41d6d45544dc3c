"""GGUF blocks kept quantized (layers/quantization/gguf.py): for every supported block type, the layer's product
equals x times gguf's own dequantization of the blocks through the grouped-integer kernel, in float32 and bfloat16,
and each row of it does not depend on the other rows; the kernel's product is exactly the integer arithmetic it
states; types it does not keep, and layers mixing them, are dequantized and multiply exactly; mixed kept types share
one packing."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernel_selection import resolve_quantization
from pagedllm.layers.embedding import ParallelLMHead
from pagedllm.layers.kernel_choices import KernelChoices, building_with_kernels
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear
from pagedllm.layers.quantization.cpu_grouped_gemm import dequantize
from pagedllm.layers.quantization.gguf import (
    DECODERS,
    GGUFLinearMethod,
    GGUFVocabMethod,
    decode,
    describe_formats,
    pack,
)
from pagedllm.layers.step_rows import computing
from pagedllm.loader.checkpoint_tensor import CheckpointTensor, QuantizedBlocks

K = 512  # two K-quant super-blocks per row
HALF_FLOAT_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2]}
HALF_FLOAT_FIELDS |= {"Q5_K": [0, 2], "Q6_K": [208]}
# activations rounded to int16 per group of 32: the product's error is ~2e-5 of the output's largest magnitude here;
# a bfloat16 model's activations and output are bfloat16 (~4e-3)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def random_blocks(format: str, rows: int, seed: int = 0) -> np.ndarray:
    """Random bytes as `format`'s blocks, each float16 field (scales, minimums) a finite random value."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[format]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * K // block_size, block_bytes), dtype=np.uint8)
    for offset in HALF_FLOAT_FIELDS[format]:
        halves = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def blocks_tensor(format: str, raw: np.ndarray) -> tuple[CheckpointTensor, torch.Tensor]:
    """The checkpoint tensor of `raw` blocks as the GGUF loader yields it, and gguf's float32 dequantization."""
    tensor_type = gguf.GGMLQuantizationType[format]
    dense = torch.from_numpy(gguf.quants.dequantize(raw, tensor_type).reshape(raw.shape[0], K).copy())
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rows = torch.from_numpy(raw)
    blocks = QuantizedBlocks(format, block_size, block_bytes, lambda part: rows[part])
    return CheckpointTensor.lazy("w", (raw.shape[0], K), dense.__getitem__, torch.float32, blocks), dense


def loaded_layer(
    parts: list[str], sizes: list[int], dtype: torch.dtype, prompt_rows: str = "integer"
) -> tuple[torch.nn.Module, torch.Tensor]:
    """A q/k/v layer (three parts) or a one-part layer loaded from blocks of the given formats; its dense weight."""
    torch.set_default_dtype(dtype)
    try:
        with building_with_kernels(KernelChoices(quantization="gguf", linear="onednn", gguf_prompt_rows=prompt_rows)):
            if len(parts) == 3:
                layer = QKVParallelLinear(K, 32, sizes[0] // 32, sizes[1] // 32)
            else:
                layer = ColumnParallelLinear(K, sizes[0])
    finally:
        torch.set_default_dtype(torch.float32)
    dense = []
    for index, (format, rows) in enumerate(zip(parts, sizes, strict=True)):
        loaded, weight = blocks_tensor(format, random_blocks(format, rows, seed=index))
        if len(parts) == 3:
            layer.weight_loader(layer.weight, loaded, "qkv"[index])
        else:
            layer.weight_loader(layer.weight, loaded)
        dense.append(weight)
    layer.method.finish_loading(layer)
    return layer, torch.cat(dense)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("format", sorted(DECODERS))
def test_decoded_groups_are_gguf_s_dequantization(format):
    loaded, dense = blocks_tensor(format, random_blocks(format, 96))
    decoded = DECODERS[format](torch.from_numpy(random_blocks(format, 96)).view(96, -1, loaded.blocks.block_bytes))
    torch.testing.assert_close(decoded.dequantize(), dense, rtol=1e-5, atol=1e-6)
    packed = pack(decoded)
    assert packed.values.shape == (96, K * packed.bits // 8) and packed.scales.shape == (96, 2, K // 32)
    rows = torch.tensor([0, 5, 95, 5])
    torch.testing.assert_close(packed.rows(rows, torch.float32), dense[rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format", sorted(DECODERS))
def test_kept_formats_multiply_as_their_dequantization(format, dtype):
    layer, dense = loaded_layer([format], [97], dtype)  # 97 rows: not a multiple of the kernel's 16-row tasks
    assert layer.method.quantized and layer.weight.dtype == torch.uint8
    x = torch.randn(300, K, dtype=dtype)
    out = layer(x)
    assert out.shape == (300, 97) and out.dtype == dtype
    assert relative_error(out, x.double() @ dense.double().t()) < TOLERANCE[dtype], format
    assert torch.equal(layer(x[:1]), out[:1]) and torch.equal(layer(x[7:40]), out[7:40])  # rows are independent


def test_mixed_kept_formats_share_one_packing_and_unkept_ones_dequantize_the_layer():
    layer, dense = loaded_layer(["Q4_0", "Q8_0", "Q4_K"], [128, 64, 64], torch.float32)
    assert layer.method.quantized and layer.method.packed.bits == 8  # Q4_0's and Q4_K's values widened beside Q8_0
    x = torch.randn(3, K)
    assert relative_error(layer(x), x.double() @ dense.double().t()) < TOLERANCE[torch.float32]
    layer, dense = loaded_layer(["Q4_1", "Q6_K", "Q4_1"], [128, 64, 64], torch.float32)
    assert not layer.method.quantized and layer.weight.dtype == torch.float32
    x = torch.randn(3, K)
    assert relative_error(layer(x), x.double() @ dense.double().t()) < 1e-5  # float32 all the way
    vocabulary = GGUFVocabMethod()
    vocabulary.load(torch.empty(64, K), blocks_tensor("Q6_K", random_blocks("Q6_K", 64))[0])
    model = torch.nn.ModuleList([layer, loaded_layer(["Q4_1"], [64], torch.float32)[0]])
    model.append(torch.nn.Module())
    model[-1].method = vocabulary
    assert describe_formats(model) == (
        "1 linear layers kept quantized (Q4_1 x 1); 1 dequantized, their types not kept (Q4_1+Q6_K x 1); "
        "vocabulary dequantized (Q6_K)"
    )


def test_a_shard_cut_across_blocks_is_dequantized():
    loaded, dense = blocks_tensor("Q4_K", random_blocks("Q4_K", 64))
    assert loaded.narrow(1, 256, 256).read_blocks() is not None
    assert loaded.narrow(1, 128, 256).read_blocks() is None  # a super-block holds 256 values
    method = GGUFLinearMethod()
    layer = torch.nn.Module()
    method.create_weights(layer, 256, 64, bias=False)
    method.load(layer.weight, loaded.narrow(1, 128, 256))
    method.finish_loading(layer)
    assert not method.quantized and torch.equal(layer.weight.data, dense[:, 128:384])


def test_gguf_blocks_are_kept_by_default_on_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cpu, checkpoint_format="gguf") == "gguf"
    assert resolve_quantization("auto", cuda, checkpoint_format="gguf") is None  # dequantized on a GPU
    assert resolve_quantization(None, cpu, checkpoint_format="gguf") is None
    assert resolve_quantization("none", cpu, checkpoint_format="gguf") is None  # the command line's None
    with pytest.raises(ValueError, match="quantization='gguf': GGUF weights run on the CPU, the device is cuda"):
        resolve_quantization("gguf", cuda, checkpoint_format="gguf")
    with pytest.raises(ValueError, match="quantization='gguf': GGUF weights need a GGUF file as the model"):
        resolve_quantization("gguf", cpu, checkpoint_format=None)


def int16_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations: each group of 32 as int16 q and a step, x ~ q x step, step = max |x| / 32767."""
    groups = x.float().view(x.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    # Divided in numpy: IEEE float32 division, as the kernel's. torch's CPU `32767 / largest` is off by an ulp in
    # some groups on AVX-512 machines (32 of 144 groups measured), which moves a q by one now and then.
    with np.errstate(divide="ignore"):
        inverse = torch.from_numpy(np.where(largest.numpy() > 0, np.float32(32767) / largest.numpy(), np.float32(0)))
    steps = torch.from_numpy(largest.numpy() / np.float32(32767))
    return torch.round(groups * inverse).double(), steps.double()


@pytest.mark.parametrize("format", ["Q4_1", "Q8_0", "Q5_K"])
def test_the_kernel_computes_the_integer_arithmetic_it_states(format):
    loaded, _ = blocks_tensor(format, random_blocks(format, 40))
    decoded = decode(loaded)
    packed = pack(decoded)
    generator = torch.Generator().manual_seed(sum(map(ord, format)))
    x = torch.randn(9, K, generator=generator) * torch.logspace(-3, 2, K)  # groups of very different magnitudes
    x[3, :64] = 0  # all-zero groups
    q, step = int16_rounded(x)
    values = decoded.values.double().view(40, -1, 32)
    dots = torch.einsum("mgj,ngj->mng", q, values)  # exact in float64: integers below 2^53
    expected = (dots * step[:, None, :, 0] * decoded.scales.double()).sum(-1)
    expected += (q.sum(-1) * step[..., 0]) @ decoded.offsets.double().t()
    assert relative_error(packed.multiply(x), expected) < 1e-6


@pytest.mark.parametrize("format", ["Q8_0", "Q4_1"])
def test_a_kept_vocabulary_embeds_and_multiplies_as_its_dequantization(format):
    with building_with_kernels(KernelChoices(quantization="gguf")):
        head = ParallelLMHead(200, K)
    loaded, dense = blocks_tensor(format, random_blocks(format, 200))
    head.weight_loader(head.weight, loaded)
    assert head.quantized and head.weight.numel() == 0  # the float weight emptied (a tied embedding's too)
    ids = torch.tensor([[0, 1, 33, 63], [64, 150, 199, 1]])
    scale = dense.abs().max()
    assert ((head(ids) - dense[ids]).abs().max() / scale) < 1e-6  # float32 scales
    hidden = torch.randn(3, K)
    assert relative_error(head.compute_logits(hidden), hidden.double() @ dense.double().t()) < TOLERANCE[torch.float32]


def step(query_lens: list[int], decoding: list[int] | None, decode_only: bool = False) -> AttentionMetadata:
    """A step's metadata as far as step_rows reads it: each sequence's new rows and whether it is past its prompt."""
    starts = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    none = torch.zeros(len(query_lens), dtype=torch.int32)
    return AttentionMetadata(
        torch.zeros(0), starts, none, none[:, None], max(query_lens), 0, decode_only,
        None if decoding is None else np.array(decoding, np.int32),
    )  # fmt: skip


@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_dequantized_groups_are_the_groups_dequantization_bit_for_bit(format):
    loaded, _ = blocks_tensor(format, random_blocks(format, 48))
    groups = decode(loaded)
    packed = pack(groups)
    assert torch.equal(dequantize(packed.values, packed.scales, packed.bits), groups.dequantize())


@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
def test_a_steps_prompt_rows_multiply_the_weight_in_float_and_its_decoding_rows_take_the_kernel(format):
    layer, dense = loaded_layer([format], [64], torch.float32, prompt_rows="float")
    packed = layer.method.packed
    weight = dequantize(packed.values, packed.scales, packed.bits)
    # a prompt chunk of 40 rows, a decode row, a verify row of 4, the first 3 rows of a prompt, a 20-row chunk
    query_lens, decoding = [40, 1, 4, 3, 20], [0, 1, 1, 0, 0]
    x = torch.randn(sum(query_lens), K)
    prompt = torch.tensor([*range(40), *range(45, 68)])
    decoding_rows = torch.tensor(range(40, 45))
    with computing(step(query_lens, decoding)):
        out = layer(x)
    assert torch.equal(out[prompt], torch.nn.functional.linear(x[prompt], weight))
    assert torch.equal(out[decoding_rows], packed.multiply(x[decoding_rows]))
    assert relative_error(out[prompt], x[prompt].double() @ dense.double().t()) < 1e-6  # no rounding of x
    with computing(step(query_lens, None)):  # no sequence past its prompt: every row in float
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))
    with computing(step([1] * 5, None, decode_only=True)):  # a decode step: every row on the kernel
        assert torch.equal(layer(x[:5]), packed.multiply(x[:5]))
    assert torch.equal(layer(x), packed.multiply(x))  # outside a step (a warm-up, a test): the kernel
    integer_layer, _ = loaded_layer([format], [64], torch.float32)
    with computing(step(query_lens, decoding)):  # PAGEDLLM_GGUF_FLOAT_PROMPTS=0: every row on the kernel
        assert torch.equal(integer_layer(x), packed.multiply(x))
