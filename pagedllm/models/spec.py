"""DecoderSpec: the numbers and flags that tell one Llama-family decoder from another, read from a HF config."""

from __future__ import annotations

from dataclasses import dataclass

# architecture name in config.json -> flags that differ from plain Llama
ARCHITECTURE_FLAGS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias turns on both qkv and o biases
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    sliding_window: int | None = None

    def num_parameters(self) -> int:
        """The model's parameters (an untied head counted beside the embedding; biases and norms included)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv) * self.qkv_bias + self.hidden_size * self.o_bias + 2 * self.head_dim * self.qk_norm
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + self.hidden_size

    @classmethod
    def from_hf_config(cls, config) -> DecoderSpec:
        architecture = supported_architecture(config)
        flags = dict(ARCHITECTURE_FLAGS[architecture])
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        attention_bias = bool(getattr(config, "attention_bias", False))
        flags["qkv_bias"] = flags.get("qkv_bias", False) or attention_bias
        flags["o_bias"] = attention_bias
        theta, scaling = rope_settings(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        uses_window = architecture == "MistralForCausalLM" or getattr(config, "use_sliding_window", False)
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=getattr(config, "sliding_window", None) if uses_window else None,
            **flags,
        )


def supported_architecture(config) -> str:
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in ARCHITECTURE_FLAGS:
            return name
    raise ValueError(
        f"unsupported model architecture {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(ARCHITECTURE_FLAGS)}"
    )


def rope_settings(config) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5's rope_parameters or 4.x's rope_theta/rope_scaling."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        scaling = None if parameters.get("rope_type", "default") == "default" else dict(parameters)
        return float(parameters.get("rope_theta", 10000.0)), scaling
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)
