"""Model classes by the `architectures` name in config.json."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.parallel_state import tp_size
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.spec import ARCHITECTURE_FLAGS, DecoderSpec

MODEL_CLASSES: dict[str, type[nn.Module]] = dict.fromkeys(ARCHITECTURE_FLAGS, LlamaForCausalLM)


def check_tensor_parallel_size(spec: DecoderSpec, size: int) -> None:
    """Heads and MLP width must split evenly; KV heads split evenly or are replicated (size a multiple of them)."""
    for what, count in (("num_attention_heads", spec.num_heads), ("intermediate_size", spec.intermediate_size)):
        if count % size:
            raise ValueError(
                f"{what}={count} is not divisible by tensor_parallel_size={size}; "
                f"choose a tensor_parallel_size that divides {count}"
            )
    kv_heads = spec.num_kv_heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} and tensor_parallel_size={size}: one must divide the other "
            "(KV heads are split among ranks, or replicated when there are more ranks than KV heads)"
        )


def build_model(spec: DecoderSpec, max_position: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An uninitialised model of spec's architecture, its parameters already in dtype on device, sharded for the
    tensor-parallel group it is built with (layers/parallel_state.building_with)."""
    check_tensor_parallel_size(spec, tp_size())
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return MODEL_CLASSES[spec.architecture](spec, max_position).eval()
    finally:
        torch.set_default_dtype(previous_dtype)
