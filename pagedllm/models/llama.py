"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): packed qkv and gate_up, fused residual norms.

Module names follow the Hugging Face checkpoints, so a checkpoint name maps to a parameter by replacing only
the packed pieces listed in PACKED_MODULES.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.kernel_choices import kernel_choices
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.step_rows import computing
from pagedllm.models.cpu_decode_stack import CpuDecodeStack
from pagedllm.models.spec import DecoderSpec

# checkpoint module name -> (packed module name, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SelfAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, bias=spec.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, spec.head_dim, scale=spec.head_dim**-0.5)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        # triton, cpu: the q/k norms and the rotation as one kernel, in place in qkv (query and key view it)
        self.rotary_kernel = kernel_choices().rotary
        self.rotates_in_place = self.rotary_kernel != "torch"

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        query = query.view(-1, self.num_heads, self.head_dim)
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotates_in_place:
            self.rotate_in_place(qkv, positions)
            return self.o_proj(self.attn(query, key, value, metadata))
        # Every layer shares the rotary table, so the first layer's rows serve the step.
        rows = metadata.once("rotary rows", lambda: self.rotary_emb.rows(positions))
        if self.qk_norm:
            query, key = self.rotary_emb(self.q_norm(query), rows), self.rotary_emb(self.k_norm(key), rows)
        else:  # q and k are neighbours in qkv: one rotation for both
            qk = self.rotary_emb(
                qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rows
            )
            query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(query, key, value, metadata))

    def rotate_in_place(self, qkv: torch.Tensor, positions: torch.Tensor) -> None:
        if self.rotary_kernel == "cpu":
            rotate_qk_ = torch.ops.pagedllm_cpu.rotate_qk_  # the same arguments as the Triton kernel's
        else:
            from pagedllm.kernels.rotary import rotate_qk_  # imports Triton: only where the choices take this kernel
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        rotate_qk_(qkv, positions, self.rotary_emb.cos_sin, self.num_heads, self.num_kv_heads, self.head_dim, *norms)


class GatedMLP(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = SelfAttention(spec, rotary_emb)
        self.mlp = GatedMLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        # One cos/sin table for all layers (a table a layer: 63 MB for SmolLM2's 30 layers x 8,192 positions, 587 MB
        # for Qwen3-0.6B's 28 x 40,960).
        rotary_emb = RotaryEmbedding(spec.head_dim, max_position, spec.rope_theta, spec.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary_emb) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # The layers of a step whose rows all decode in one C++ call (the same kernels): a plain attribute, not a
        # module (it holds the layers' tensors, not parameters of its own)
        self.decode_stack = CpuDecodeStack(self.layers) if kernel_choices().decode_steps == "cpu" else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        stacked = None if self.decode_stack is None else self.decode_stack(hidden, positions, metadata)
        if stacked is not None:
            hidden, residual = stacked
        else:
            residual = None
            with computing(metadata):  # the linear methods that multiply prompt rows apart see the step's rows
                for layer in self.layers:
                    hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; `spec` carries every difference between the families."""

    packed_modules = PACKED_MODULES

    def __init__(self, spec: DecoderSpec, max_position: int):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, max_position)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size)
        if spec.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
