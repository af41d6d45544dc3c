"""Which kernel each part of the model and the sampler runs, decided once at start-up (pagedllm/kernel_selection.py)
and handed to the layers while the model is built (`building_with_kernels`), as the tensor-parallel group is: a
layer reads the choices current in its __init__ and keeps them, so no layer branches on where a tensor lives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class KernelChoices:
    """The defaults are plain torch everywhere: what runs on CPU, and on a GPU with attention_backend='torch'."""

    attention: Literal["torch", "triton", "cpu"] = "torch"  # the attention backend (attention/selector.py)
    # The torch and cpu backends' prompt chunks on CPU: SDPA's math path (3-D tensors) or its flash kernel (4-D: 4.3x
    # faster at 800 rows). The result of a row differs in its last bits; the choice is made in kernel_selection.
    torch_prompt_sdpa: Literal["math", "flash"] = "math"
    # triton / cpu: q/k norms and rotation in one kernel (kernels/rotary.py / layers/cpu_layer_ops.cpp), in place in qkv
    rotary: Literal["torch", "triton", "cpu"] = "torch"
    # The norms (with their residual add) and SiLU-and-mul: torch expressions (compiled where `compile`), or cpu:
    # one C++ call each (layers/cpu_layer_ops.cpp)
    layer_ops: Literal["torch", "cpu"] = "torch"
    # cpu: a step whose rows all decode (decode, verify) runs the decoder layers as one C++ call that calls the same
    # kernels (models/cpu_decode_stack.py); modules: each layer's modules from Python, every step
    decode_steps: Literal["modules", "cpu"] = "modules"
    # skinny_gemm: small products may take kernels/skinny_gemm (the GEMV, the skinny GEMM); onednn: weights
    # reordered once for oneDNN (CPU); cpu: float32 weights packed once into panels for the C++ product
    # (layers/cpu_float_gemm.cpp), other dtypes as onednn (layers/linear_method.py)
    linear: Literal["torch", "skinny_gemm", "onednn", "cpu"] = "torch"
    sampler: Literal["torch", "triton_race"] = "torch"  # triton_race: plain races in kernels/race_sampling
    compile: bool = False  # torch.compile the element-wise functions (layers/compile.py)
    # The linear layers' weights (layers/linear_method.py): None the model's dtype; fp8 with scales per row or 128 x 128
    # block; gguf: a GGUF file's blocks kept quantized (layers/quantization/gguf.py)
    quantization: Literal[None, "fp8_rows", "fp8_blocks", "gguf"] = None
    # gguf: a step's prompt-chunk rows multiply the weight dequantized to float (a GEMM), or the grouped-integer
    # kernel as the rows that decode do (layers/quantization/gguf.py)
    gguf_prompt_rows: Literal["integer", "float"] = "integer"
    # Not a kernel: host <-> device copies stage through pinned memory, asynchronously (a CUDA device).
    pin_memory: bool = False

    def describe(self) -> str:
        """One line for the start-up log."""
        prompts = " (flash prompts)" if self.torch_prompt_sdpa == "flash" else ""
        return (
            f"attention {self.attention}{prompts}, rotary {self.rotary}, layer ops {self.layer_ops}, "
            f"decode steps {self.decode_steps}, "
            f"linear {self.linear}, sampler {self.sampler}, "
            f"compile {'on' if self.compile else 'off'}, weights {self.quantization or 'unquantized'}"
            + (" (prompt rows in float)" if self.gguf_prompt_rows == "float" else "")
        )


TORCH_KERNELS = KernelChoices()
_building = TORCH_KERNELS  # the choices of the model being built


@contextmanager
def building_with_kernels(choices: KernelChoices) -> Iterator[None]:
    """Layers created inside this block run the kernels `choices` names."""
    global _building
    previous, _building = _building, choices
    try:
        yield
    finally:
        _building = previous


def kernel_choices() -> KernelChoices:
    """The choices of the model being built (plain torch outside `building_with_kernels`)."""
    return _building
