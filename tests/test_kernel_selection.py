"""resolve_kernel_choices: today's kernels on CUDA by default, the in-place C++ attention and oneDNN linear layers on
CPU, plain torch with attention_backend='torch' on a GPU, the environment read when resolving. CUDA is a
torch.device here: resolving only reads its type (and, for an fp8 cache, its compute capability, replaced here), so
no GPU is needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm import kernel_selection
from pagedllm.attention import selector
from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.layers.kernel_choices import TORCH_KERNELS, KernelChoices

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SWITCHES = (
    "PAGEDLLM_SKINNY_GEMM", "PAGEDLLM_FUSED_SAMPLER", "PAGEDLLM_COMPILE", "PAGEDLLM_ONEDNN_LINEAR",
    "PAGEDLLM_CPU_FLOAT_GEMM", "PAGEDLLM_CPU_LAYER_OPS", "PAGEDLLM_CPU_DECODE_STACK", "PAGEDLLM_GGUF_FLOAT_PROMPTS",
)  # fmt: skip
CPU_KERNELS = KernelChoices(
    attention="cpu", rotary="cpu", layer_ops="cpu", decode_steps="cpu", linear="cpu", torch_prompt_sdpa="flash"
)
TODAYS_CUDA = KernelChoices(
    attention="triton", rotary="triton", linear="skinny_gemm", sampler="triton_race", compile=True, pin_memory=True
)


@pytest.fixture(autouse=True)
def triton_and_defaults(monkeypatch):
    """Triton installed, the switches unset."""
    monkeypatch.setattr(selector, "triton_installed", lambda: True)
    monkeypatch.setattr(kernel_selection, "triton_installed", lambda: True)
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def test_cpu_runs_the_in_place_attention_and_the_cpu_linear_layers(monkeypatch):
    assert resolve_kernel_choices(None, CPU, 64) == CPU_KERNELS
    assert resolve_kernel_choices("cpu", CPU, 64, "fp8") == CPU_KERNELS
    # the decode stack calls the cpu attention kernel: with the torch backend, decode steps run the modules
    torch_attention = dataclasses.replace(CPU_KERNELS, attention="torch", decode_steps="modules")
    assert resolve_kernel_choices("torch", CPU, 64, "fp8") == torch_attention
    monkeypatch.setenv("PAGEDLLM_CPU_FLOAT_GEMM", "0")  # float32 weights through oneDNN too
    assert resolve_kernel_choices(None, CPU, 64) == dataclasses.replace(CPU_KERNELS, linear="onednn")
    monkeypatch.setenv("PAGEDLLM_ONEDNN_LINEAR", "0")
    assert resolve_kernel_choices(None, CPU, 64) == dataclasses.replace(CPU_KERNELS, linear="torch")
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "0")
    without_stack = dataclasses.replace(CPU_KERNELS, linear="torch", decode_steps="modules")
    assert resolve_kernel_choices(None, CPU, 64) == without_stack
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "1")
    monkeypatch.setenv("PAGEDLLM_CPU_LAYER_OPS", "0")
    assert resolve_kernel_choices(None, CPU, 64) == KernelChoices(attention="cpu", torch_prompt_sdpa="flash")


def test_without_the_cpu_kernels_the_layers_small_ops_stay_torch_expressions(monkeypatch):
    monkeypatch.setattr(kernel_selection.cpu_kernels, "unavailable_reason", lambda: "no compiler here")
    choices = resolve_kernel_choices(None, CPU, 64)
    assert (choices.attention, choices.rotary, choices.layer_ops, choices.decode_steps) == ("torch",) * 3 + ("modules",)
    assert choices.linear == "onednn"  # the panels are a CPU kernel too


def test_cpu_prompt_rows_take_float_products_and_sdpas_flash_kernel(monkeypatch):
    """Float weights, and GGUF blocks kept with their prompt rows multiplied in float: the flash kernel; GGUF prompt
    rows through the grouped kernel (PAGEDLLM_GGUF_FLOAT_PROMPTS=0): SDPA's math path, as before session 29."""
    float_weights = resolve_kernel_choices(None, CPU, 64, quantization=None)
    assert (float_weights.torch_prompt_sdpa, float_weights.gguf_prompt_rows) == ("flash", "integer")
    gguf = resolve_kernel_choices(None, CPU, 64, quantization="gguf")
    assert (gguf.torch_prompt_sdpa, gguf.gguf_prompt_rows) == ("flash", "float")
    assert "weights gguf (prompt rows in float)" in gguf.describe()
    monkeypatch.setenv("PAGEDLLM_GGUF_FLOAT_PROMPTS", "0")
    gguf = resolve_kernel_choices(None, CPU, 64, quantization="gguf")
    assert (gguf.torch_prompt_sdpa, gguf.gguf_prompt_rows) == ("math", "integer")
    assert TORCH_KERNELS.torch_prompt_sdpa == "math"  # the torch backend on a GPU: as before


def test_cuda_runs_todays_kernels_by_default():
    assert resolve_kernel_choices(None, CUDA, 128) == TODAYS_CUDA
    assert resolve_kernel_choices("triton", CUDA, 64) == TODAYS_CUDA


def test_torch_attention_on_cuda_means_plain_torch_everywhere():
    choices = resolve_kernel_choices("torch", CUDA, 128)
    assert choices == KernelChoices(pin_memory=True)  # only the copies still stage through pinned memory
    assert (choices.attention, choices.rotary, choices.linear, choices.sampler) == ("torch",) * 4
    assert not choices.compile


def test_without_triton_cuda_runs_plain_torch(monkeypatch):
    monkeypatch.setattr(selector, "triton_installed", lambda: False)
    monkeypatch.setattr(kernel_selection, "triton_installed", lambda: False)
    assert resolve_kernel_choices(None, CUDA, 128) == KernelChoices(pin_memory=True)


def test_a_model_the_attention_kernels_cannot_take_falls_back_in_attention_only(monkeypatch):
    """As before the choices were one object: the fallback (one warning) is the attention backend's alone."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve_kernel_choices(None, CUDA, 128, "fp8") == KernelChoices(
        attention="torch", rotary="triton", linear="skinny_gemm", sampler="triton_race", compile=True, pin_memory=True
    )
    assert resolve_kernel_choices(None, CUDA, 100).attention == "torch"  # head_dim no multiple of 8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kernel_choices(None, CUDA, 128, "fp8") == TODAYS_CUDA


@pytest.mark.parametrize(
    ("name", "field", "off"),
    [("PAGEDLLM_SKINNY_GEMM", "linear", "torch"), ("PAGEDLLM_FUSED_SAMPLER", "sampler", "torch"),
     ("PAGEDLLM_COMPILE", "compile", False)],
)  # fmt: skip
def test_each_switch_is_read_when_resolving(monkeypatch, name, field, off):
    monkeypatch.setenv(name, "0")  # after every import
    choices = resolve_kernel_choices(None, CUDA, 128)
    assert getattr(choices, field) == off
    assert choices.attention == choices.rotary == "triton"
    monkeypatch.setenv(name, "1")
    assert resolve_kernel_choices(None, CUDA, 128) == TODAYS_CUDA
    assert resolve_kernel_choices(None, CPU, 128) == CPU_KERNELS  # the switches only turn CUDA kernels off


def test_the_start_up_line_names_every_choice():
    line = TODAYS_CUDA.describe()
    assert (
        line == "attention triton, rotary triton, layer ops torch, decode steps modules, linear skinny_gemm, sampler "
        "triton_race, compile on, weights unquantized"
    )
    assert (
        TORCH_KERNELS.describe()
        == "attention torch, rotary torch, layer ops torch, decode steps modules, linear torch, sampler torch, "
        "compile off, weights unquantized"
    )
