"""FP8 weights on CPU, where they do not run: the choice of weight format (resolved with a stand-in GPU), the clear
error for quantization='fp8' on CPU, and the method's conversion of a loaded weight (row and block scales)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, kernel_selection
from pagedllm.kernel_selection import resolve_quantization
from pagedllm.layers.kernel_choices import KernelChoices, building_with_kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization.fp8 import FP8, Fp8LinearMethod, dequantize_blocks
from pagedllm.loader.checkpoint_tensor import CheckpointTensor

CUDA = torch.device("cuda")


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 with Triton, as far as the resolver can tell."""
    monkeypatch.setattr(kernel_selection, "triton_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("PAGEDLLM_FP8_SCALING", raising=False)


def test_an_fp8_checkpoint_keeps_fp8_weights_where_the_gpu_runs_them(hopper, monkeypatch):
    assert resolve_quantization("auto", CUDA, checkpoint_format="fp8") == "fp8_rows"
    assert resolve_quantization("auto", CUDA, checkpoint_format=None) is None
    assert resolve_quantization("fp8", CUDA, checkpoint_format=None) == "fp8_rows"
    assert resolve_quantization(None, CUDA, checkpoint_format="fp8") is None  # None: dequantized
    monkeypatch.setenv("PAGEDLLM_FP8_SCALING", "blocks")  # read when resolving
    assert resolve_quantization("auto", CUDA, checkpoint_format="fp8") == "fp8_blocks"
    # plain torch everywhere: the checkpoint is dequantized unless fp8 is asked for
    assert resolve_quantization("auto", CUDA, checkpoint_format="fp8", attention_backend="torch") is None


def test_an_fp8_checkpoint_is_dequantized_where_the_gpu_cannot_run_fp8(hopper, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve_quantization("auto", CUDA, checkpoint_format="fp8") is None
    with pytest.raises(ValueError, match=r"compute capability 9.0 or newer, this GPU has \(8, 0\)"):
        resolve_quantization("fp8", CUDA, checkpoint_format=None)
    assert resolve_quantization("auto", torch.device("cpu"), checkpoint_format="fp8") is None


def test_a_bad_scaling_variable_names_itself(hopper, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FP8_SCALING", "columns")
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_SCALING='columns' is not valid"):
        resolve_quantization("fp8", CUDA, checkpoint_format=None)


def test_fp8_weights_on_cpu_are_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="quantization='fp8': fp8 weights need a CUDA GPU, the device is cpu"):
        LLM(llama_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM(llama_dir, quantization="int4")


def loaded_layer(scaling: str, in_features: int, out_features: int = 80) -> tuple[ColumnParallelLinear, torch.Tensor]:
    weight = torch.randn(out_features, in_features) * 0.05
    with building_with_kernels(KernelChoices(quantization=f"fp8_{scaling}")):
        layer = ColumnParallelLinear(in_features, out_features)
    assert isinstance(layer.method, Fp8LinearMethod)
    layer.weight_loader(
        layer.weight, CheckpointTensor.lazy("w", tuple(weight.shape), weight.__getitem__, torch.float32)
    )
    layer.method.finish_loading(layer)
    return layer, weight


def test_the_method_quantizes_the_loaded_weight_per_row():
    layer, weight = loaded_layer("rows", in_features=96)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (80, 1)
    error = (layer.weight.float() * layer.weight_scale - weight).norm() / weight.norm()
    assert error < 0.04  # e4m3: 3 mantissa bits


def test_the_method_quantizes_the_loaded_weight_per_block():
    layer, weight = loaded_layer("blocks", in_features=1024, out_features=208)  # a ragged last row block
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (2, 8)
    error = (dequantize_blocks(layer.weight, layer.weight_scale) - weight).norm() / weight.norm()
    assert error < 0.04


def test_shapes_the_fp8_product_cannot_take_are_refused():
    with pytest.raises(ValueError, match="in_features divisible by 512 on each rank, this layer has 256"):
        loaded_layer("blocks", in_features=256)
    with pytest.raises(ValueError, match="divisible by 16 on each rank, this layer has 200 x 80"):
        loaded_layer("rows", in_features=200)
