"""Model classes by the `architectures` name in config.json."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.parallel_state import tp_size
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.spec import ARCHITECTURE_FLAGS, DecoderSpec

MODEL_CLASSES: dict[str, type[nn.Module]] = dict.fromkeys(ARCHITECTURE_FLAGS, LlamaForCausalLM)


def build_model(spec: DecoderSpec, max_position: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An uninitialised model of spec's architecture, its parameters already in dtype on device."""
    for what, count in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads)):
        if count % tp_size():
            raise ValueError(
                f"{what}={count} is not divisible by tensor_parallel_size={tp_size()}; "
                f"choose a tensor_parallel_size that divides {count}"
            )
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return MODEL_CLASSES[spec.architecture](spec, max_position).eval()
    finally:
        torch.set_default_dtype(previous_dtype)
