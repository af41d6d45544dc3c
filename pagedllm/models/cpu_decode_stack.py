"""The decode stack: on CPU, a step whose rows all decode (decode and verify steps) runs every decoder layer in one
C++ call (cpu_decode_stack.cpp) instead of each layer's modules from Python. It calls the kernels the modules call,
in their order, so its hidden states are the modules' to the bit; what it saves is the Python between the kernels
(~200 us a layer: 30-43% of a one-sequence step of the default model, benchmarks/NOTES.md, session 28).

The model keeps its modules: prompt steps run through them, and so does every step where the stack cannot compute
what they compute (the reason is logged once): several tensor-parallel ranks (the all-reduce), an fp8 cache or one
in another dtype than the model's (the torch backend's store), a linear method the stack has no call for (fp8
weights). The stack holds the layers' tensors and the KV cache they are bound to; it is built on the first decode
step after the cache is bound, and again if the cache is bound anew.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.cpu_backend import block_tables, step_layout, stores_in_cpp
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu_kernels import require
from pagedllm.logger import logger


def product(linear: nn.Module, with_bias: bool) -> torch.ScriptObject | None:
    """The stack's call for this linear layer's product (its method's kernel and tensors), or None."""
    operands = linear.method.cpu_product(linear)
    if operands is None:
        return None
    kind, weight, scales = operands
    return torch.classes.pagedllm_cpu.Product(kind, weight, scales, linear.bias if with_bias else None)


def unsupported_reason(layers: list[nn.Module]) -> str | None:
    """Why the stack cannot compute what these layers' modules (llama.DecoderLayer) compute, or None."""
    first = layers[0].self_attn
    if first.qkv_proj.tp.size > 1:
        return "several tensor-parallel ranks"
    for layer in layers:
        attention = layer.self_attn.attn
        if attention.backend is None or attention.backend.name != "cpu":
            return "the attention backend is not the cpu one"
        model_dtype = layer.input_layernorm.weight.dtype
        if not stores_in_cpp(model_dtype, attention.k_cache, attention.k_scale):
            return f"the KV cache holds {attention.k_cache.dtype}, the model {model_dtype}"
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for linear in linears:
            if linear.method.cpu_product(linear) is None:
                return f"no C++ call for {type(linear.method).__name__}'s product"
    return None


def build(layers: list[nn.Module]) -> torch.ScriptObject:
    first = layers[0].self_attn
    stack = torch.classes.pagedllm_cpu.DecoderStack(
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        first.attn.scale,
        layers[0].input_layernorm.eps,  # every RMSNorm of the model (q/k norms too) takes spec.rms_norm_eps
        first.rotary_emb.cos_sin,
    )
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = (attention.q_norm.weight, attention.k_norm.weight) if attention.qk_norm else (None, None)
        stack.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            q_norm,
            k_norm,
            attention.attn.k_cache,
            attention.attn.v_cache,
            product(attention.qkv_proj, with_bias=True),
            product(attention.o_proj, with_bias=False),  # RowParallelLinear adds its bias after the product
            attention.o_proj.bias,
            product(mlp.gate_up_proj, with_bias=True),
            product(mlp.down_proj, with_bias=False),
        )
    return stack


class CpuDecodeStack:
    """The model's decode stack, built when first needed (the cache bound), or None with the reason logged once."""

    def __init__(self, layers: nn.ModuleList):
        require()  # kernel_selection chose it only where the kernels load
        self.layers = list(layers)
        self.stack: torch.ScriptObject | None = None
        self.bound_to: torch.Tensor | None = None  # the first layer's key cache when the stack was built
        self.reason: str | None = None

    def current(self) -> torch.ScriptObject | None:
        cache = self.layers[0].self_attn.attn.k_cache
        if cache is not self.bound_to:
            self.bound_to = cache
            self.reason = unsupported_reason(self.layers)
            self.stack = build(self.layers) if self.reason is None else None
            if self.reason is not None:
                logger.info("decode steps run the layers' modules: the C++ decode stack cannot take %s", self.reason)
        return self.stack

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the last layer, or None where this step is not for the stack (a prompt chunk in
        it, or a model the stack cannot take)."""
        stack = self.current()
        if stack is None:
            return None
        layout = step_layout(metadata, self.bound_to.shape[1])
        rows = layout.decoding
        if layout.chunks or rows is None or (rows.rows is not None and len(rows.rows) != hidden.shape[0]):
            return None
        return stack.forward(hidden, positions, metadata.slot_mapping, block_tables(metadata), rows.seqs, rows.visible)
