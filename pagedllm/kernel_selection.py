"""Which kernels an engine runs, resolved once at start-up (by EngineConfig.resolve, into ResolvedConfig.kernels) from
the attention backend setting, the device, the model's head_dim, the KV cache dtype and the environment
(pagedllm/envs.py). Every rank's worker builds its model (inside layers.kernel_choices.building_with_kernels), its
attention backend and its sampler with the result, and logs it.
"""

from __future__ import annotations

import torch

from pagedllm import cpu_kernels, envs
from pagedllm.attention.selector import choose_backend, default_backend, triton_installed
from pagedllm.layers.kernel_choices import KernelChoices
from pagedllm.logger import logger

FP8_WEIGHTS_MIN_CAPABILITY = (9, 0)  # torch._scaled_mm's row and block scaling: Hopper and later


def fp8_weights_unsupported_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"fp8 weights need a CUDA GPU, the device is {device.type}"
    if not triton_installed():
        return "fp8 weights quantize activations with a Triton kernel, and triton is not installed"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_WEIGHTS_MIN_CAPABILITY:
        return f"fp8 weights need compute capability 9.0 or newer, this GPU has {capability}"
    return None


def resolve_quantization(
    quantization: str | None,
    device: torch.device,
    checkpoint_format: str | None,
    attention_backend: str | None = None,
) -> str | None:
    """The linear layers' weight format. "auto": the checkpoint's where the device runs it: an FP8 checkpoint keeps
    FP8 weights where the GPU runs them (not with attention_backend='torch': plain torch everywhere), a GGUF file
    its blocks on CPU; dequantized elsewhere. "fp8" or "gguf": that format, or a ValueError saying why it cannot run
    here. None (or "none"): unquantized. Row or block scaling of fp8 from PAGEDLLM_FP8_SCALING. FP8 weights
    quantize activations with a Triton kernel, asked for or not."""
    if quantization == "gguf" or (quantization == "auto" and checkpoint_format == "gguf"):
        reason = gguf_weights_unsupported_reason(device, checkpoint_format)
        if quantization == "gguf" and reason is not None:
            raise ValueError(f"quantization='gguf': {reason}; use quantization=None (dequantized weights)")
        if reason is not None and device.type == "cpu" and checkpoint_format == "gguf":
            logger.warning("GGUF blocks dequantized: %s", reason)
        return "gguf" if reason is None else None
    if quantization in (None, "none") or (quantization == "auto" and checkpoint_format != "fp8"):
        return None  # 16-bit weights: nothing to ask the device
    reason = fp8_weights_unsupported_reason(device)
    if quantization == "fp8" and reason is not None:
        raise ValueError(f"quantization='fp8': {reason}; use quantization=None (16-bit weights)")
    if quantization == "fp8" or (reason is None and attention_backend != "torch"):
        return f"fp8_{envs.FP8_SCALING.get()}"
    return None


def gguf_weights_unsupported_reason(device: torch.device, checkpoint_format: str | None) -> str | None:
    if checkpoint_format != "gguf":
        return "GGUF weights need a GGUF file as the model"
    if device.type != "cpu":
        return f"GGUF weights run on the CPU, the device is {device.type}"
    return cpu_kernels.unavailable_reason()  # built on the first call


def cpu_gguf_prompt_rows(quantization: str | None) -> str:
    """With GGUF blocks kept, a prompt's rows multiply the weights dequantized to float (a GEMM: 32 chats 1.13x and
    nano-vllm's 64 sequences 1.26x faster end to end, benchmarks/NOTES.md session 29) unless
    PAGEDLLM_GGUF_FLOAT_PROMPTS=0; decoding rows keep the grouped kernel either way."""
    return "float" if quantization == "gguf" and envs.GGUF_FLOAT_PROMPTS.get() else "integer"


def cpu_prompt_sdpa(quantization: str | None, gguf_prompt_rows: str) -> str:
    """SDPA's flash kernel for prompt chunks with float products (prefill of 32 chats 1.24x faster in float32, 1.9x
    in bfloat16, benchmarks/NOTES.md). Where a GGUF model's prompt rows take the grouped kernel (gguf_prompt_rows,
    from cpu_gguf_prompt_rows), the linear layers set a prompt's pace (1.01x measured in session 22): there the math
    path stays."""
    return "math" if quantization == "gguf" and gguf_prompt_rows == "integer" else "flash"


def asked_attention_backend(name: str | None, device: torch.device) -> str:
    """`name`, or the device's default backend (triton on CUDA, cpu on CPU): what config.attention_backend records.
    The backend that runs may still fall back to torch (resolve_kernel_choices)."""
    return name or default_backend(device)


def resolve_kernel_choices(
    attention_backend: str | None,
    device: torch.device,
    head_dim: int,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> KernelChoices:
    """On CUDA by default: the Triton attention (or torch, with one warning, for a model its kernels cannot take),
    the Triton rotary kernel, and the skinny GEMM, the fused race sampler and torch.compile unless their variables
    turn them off. On CPU, the linear layers through oneDNN (where torch has it, unless PAGEDLLM_ONEDNN_LINEAR=0),
    their float32 weights through the C++ panel product instead (where the CPU kernels build, unless
    PAGEDLLM_CPU_FLOAT_GEMM=0), and the layers' small ops and rotation in C++ (where the CPU kernels build, unless
    PAGEDLLM_CPU_LAYER_OPS=0), and with them and the cpu attention, decode steps as one C++ call (unless
    PAGEDLLM_CPU_DECODE_STACK=0); plain torch elsewhere. Plain torch everywhere with attention_backend='torch' on a
    GPU, or without Triton. `quantization`: the weight format resolve_quantization gave. Reads the environment now:
    called once per engine, by EngineConfig.resolve."""
    attention = choose_backend(attention_backend, device, head_dim, kv_cache_dtype)
    on_cuda = device.type == "cuda"
    if device.type == "cpu":
        onednn = torch.backends.mkldnn.is_available() and envs.ONEDNN_LINEAR.get()
        kernels = cpu_kernels.unavailable_reason() is None
        layer_ops = "cpu" if envs.CPU_LAYER_OPS.get() and kernels else "torch"
        panels = onednn and envs.CPU_FLOAT_GEMM.get() and kernels  # the panels leave other dtypes to oneDNN
        stack = layer_ops == "cpu" and attention == "cpu" and envs.CPU_DECODE_STACK.get()
        prompt_rows = cpu_gguf_prompt_rows(quantization)
        return KernelChoices(
            attention=attention,
            rotary=layer_ops,
            layer_ops=layer_ops,
            decode_steps="cpu" if stack else "modules",
            torch_prompt_sdpa=cpu_prompt_sdpa(quantization, prompt_rows),
            linear="cpu" if panels else "onednn" if onednn else "torch",
            quantization=quantization,
            gguf_prompt_rows=prompt_rows,
        )
    if not on_cuda or attention_backend == "torch" or not triton_installed():
        return KernelChoices(attention=attention, pin_memory=on_cuda, quantization=quantization)
    return KernelChoices(
        quantization=quantization,
        attention=attention,
        rotary="triton",
        linear="skinny_gemm" if envs.SKINNY_GEMM.get() else "torch",
        sampler="triton_race" if envs.FUSED_SAMPLER.get() else "torch",
        compile=envs.COMPILE.get(),
        pin_memory=True,
    )
