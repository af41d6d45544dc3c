"""The GGUF loader against transformers' own GGUF loading: same tensors, names, config and tokenizer, for the
default SmolLM2 model (Llama, Q4_1/Q8_0) and for tiny Qwen2/Qwen3/Llama files written here with gguf.GGUFWriter.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.loader.default_model import INSTALL_HINT, default_model_path
from pagedllm.loader.gguf_loader import converted_copy, hf_name, load_gguf
from pagedllm.logger import logger

ENGINE_CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)
TEXTS = [
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé: naïve café, 日本語のテキスト, Привет мир",
    "emoji 😀🚀👨‍👩‍👧 and flags 🇫🇷",
    "digits 1234567890 3.14159 -42 1e-5",
    'def f(x):\n    return {"a": [x ** 2 for _ in range(10)]}  # code\n\t\ttabs',
    "  leading spaces and trailing   ",
    "",
]


def rope_of(config) -> dict:
    """transformers 5 keeps theta and scaling in rope_parameters, 4.x in rope_theta/rope_scaling."""
    return getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}


def assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tied: bool) -> None:
    expected_names = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    if tied:
        torch.testing.assert_close(ours["model.embed_tokens.weight"], reference["lm_head.weight"], rtol=0, atol=0)


# ---- the default model against transformers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def converted(model_path, cache_dir):
    return load_gguf(model_path, torch.float32, cache_dir=cache_dir)  # empty cache: converts, then writes it


@pytest.fixture(scope="module")
def cached(model_path, cache_dir, converted):
    return load_gguf(model_path, torch.float32, cache_dir=cache_dir)


@pytest.fixture(scope="module", params=["converted", "cached"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference_model(default_reference):
    return default_reference  # transformers' float32 model of the same file (tests/conftest.py), loaded once a session


@pytest.fixture(scope="module")
def reference_tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


def test_tensors_match_transformers(checkpoint, reference_model):
    assert checkpoint.config.tie_word_embeddings
    assert_same_tensors(checkpoint.tensors, reference_model.state_dict(), tied=True)
    assert all(tensor.dtype == torch.float32 for tensor in checkpoint.tensors.values())


def test_config_matches_transformers(checkpoint, reference_model):
    for field in ENGINE_CONFIG_FIELDS:
        assert getattr(checkpoint.config, field) == getattr(reference_model.config, field), field
    assert rope_of(checkpoint.config) == rope_of(reference_model.config)
    assert checkpoint.config.architectures == ["LlamaForCausalLM"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(checkpoint, reference_tokenizer, text):
    ids = checkpoint.tokenizer(text).input_ids
    assert ids == reference_tokenizer(text).input_ids
    assert checkpoint.tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(checkpoint, reference_tokenizer):
    tokenizer = checkpoint.tokenizer
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4 🙂"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == reference_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.count("<|im_start|>") == 3  # the template adds SmolLM's default system message


def test_cache_entry_is_written_once(cache_dir, cached):
    entries = [path.name for path in cache_dir.iterdir()]
    assert len(entries) == 1 and entries[0].endswith("-float32")  # no staging directory left behind


# ---- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"hello, not a gguf file\n" * 10])
def test_non_gguf_file_is_a_value_error(tmp_path, content):
    path = tmp_path / "notes.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="notes.gguf.*not a readable GGUF"):
        load_gguf(path, torch.float32, use_cache=False)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_gguf(tmp_path / "absent.gguf", torch.float32)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=INSTALL_HINT):
        default_model_path()


def test_unknown_tensor_name():
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        hf_name("blk.0.ssm_conv1d.weight")


# ---- tiny files written here -----------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 64, 4, 2, 128, 2
BYTE_TOKENS = list(bytes_to_unicode().values())
TOKENS = [*BYTE_TOKENS, "Ġt", "Ġth", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows: halves -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def tiny_weights(arch: str, head_dim: int, tied: bool, bias: bool = False) -> dict[str, np.ndarray]:
    """Hugging Face names -> random float32 arrays of a 2-layer model."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (len(TOKENS), HIDDEN)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (HIDDEN,)
        shapes[prefix + "post_attention_layernorm.weight"] = (HIDDEN,)
        for proj, rows in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
            shapes[f"{prefix}self_attn.{proj}_proj.weight"] = (rows, HIDDEN)
            if arch == "qwen2" or bias:
                shapes[f"{prefix}self_attn.{proj}_proj.bias"] = (rows,)
        if arch == "qwen3":
            shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[prefix + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * head_dim)
        shapes[prefix + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[prefix + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[prefix + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def gguf_name(name: str) -> str:
    renames = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    renames |= {"model.layers.": "blk.", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k"}
    renames |= {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm"}
    renames |= {"self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate"}
    renames |= {"post_attention_layernorm": "ffn_norm", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def add_tiny_metadata(writer: gguf.GGUFWriter, head_dim: int) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 3) + [3, 3, 3])
    writer.add_token_merges(["Ġ t", "Ġt h"])
    writer.add_bos_token_id(len(TOKENS) - 3)
    writer.add_eos_token_id(len(TOKENS) - 1)
    writer.add_chat_template(TINY_TEMPLATE)


def write_tiny_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], head_dim: int, extra=None) -> None:
    """2-D weights go in as Q8_0 (q/k permuted the llama.cpp way for Llama), the rest as F32; `extra` is added as is."""
    writer = gguf.GGUFWriter(path, arch)
    add_tiny_metadata(writer, head_dim)
    for name, array in {**weights, **(extra or {})}.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = llama_cpp_permute(array, HEADS if "q_proj" in name else KV_HEADS)
        if array.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q8_0_round_trip(array: np.ndarray) -> torch.Tensor:
    quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))


# head_dim: transformers ignores the file's head_dim for qwen2/qwen3 and uses its config defaults, so match them
@pytest.mark.parametrize(
    ("arch", "tied", "head_dim"), [("qwen2", False, 16), ("qwen3", True, 128), ("llama", False, 16)]
)
def test_tiny_model_matches_written_weights_and_transformers(tmp_path, arch, tied, head_dim):
    weights = tiny_weights(arch, head_dim, tied)
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, weights, head_dim)
    checkpoint = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)

    expected = {name: q8_0_round_trip(a) if a.ndim == 2 else torch.from_numpy(a) for name, a in weights.items()}
    assert_same_tensors(checkpoint.tensors, expected, tied=False)  # permutation undone, names mapped
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    assert_same_tensors(checkpoint.tensors, reference.state_dict(), tied=tied)
    for field in ENGINE_CONFIG_FIELDS:
        if hasattr(reference.config, field):  # Qwen2Config has no head_dim; ours states it for the engine
            assert getattr(checkpoint.config, field) == getattr(reference.config, field), field
    assert checkpoint.config.architectures == [type(reference).__name__]


def test_llama_q_k_biases_are_unpermuted_too(tmp_path):
    weights = tiny_weights("llama", 16, tied=True, bias=True)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", weights, 16)
    checkpoint = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)
    assert checkpoint.config.attention_bias
    for proj in "qkv":
        name = f"model.layers.1.self_attn.{proj}_proj.bias"
        assert torch.equal(checkpoint.tensors[name], torch.from_numpy(weights[name])), name


def test_tiny_tokenizer_and_template(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", tiny_weights("qwen3", 16, tied=True), 16)
    tokenizer = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False).tokenizer
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids
    assert tokenizer(" the").input_ids[:1] == [TOKENS.index("Ġth")]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n" * 1 + (
        "<|im_start|>assistant\nyo<|im_end|>\n"
    )


def test_qwen3_head_dim_comes_from_key_length(tmp_path):
    head_dim = 32  # neither hidden / heads = 16 nor Qwen3Config's default 128
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", tiny_weights("qwen3", head_dim, tied=True), head_dim)
    checkpoint = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)
    assert checkpoint.config.head_dim == head_dim
    assert checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (HEADS * head_dim, HIDDEN)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    head_dim, theta = HIDDEN // HEADS, 500000.0
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_theta=theta, rope_scaling=scaling)
    scaled_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divisors = (inv_freq / scaled_inv_freq.double()).float().numpy()
    assert len(set(divisors.round(3))) > 2  # unscaled, fully scaled and smoothed frequencies all occur

    extra = {"rope_freqs.weight": divisors}
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tiny_weights("llama", head_dim, tied=True), head_dim, extra)
    checkpoint = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)
    assert rope_of(checkpoint.config) == rope_of(config)
    assert not any("rope" in name for name in checkpoint.tensors)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "gemma", tiny_weights("llama", 16, tied=True), 16)
    with pytest.raises(ValueError, match="'gemma'.*llama, qwen2, qwen3"):
        load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)


def test_unsupported_tensor_type_is_a_value_error(tmp_path):
    weights = tiny_weights("qwen3", 16, tied=True)
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)  # F64: gguf cannot dequantize
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", weights, 16)
    with pytest.raises(ValueError, match="output_norm.weight has type F64"):
        load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False)


def test_bfloat16_load_from_file_and_cache_is_the_float32_load_rounded(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tiny_weights("qwen2", 16, tied=False), 16)
    exact = load_gguf(tmp_path / "tiny.gguf", torch.float32, use_cache=False).tensors
    for _ in range(2):  # converts and writes the cache, then reads it
        rounded = load_gguf(tmp_path / "tiny.gguf", torch.bfloat16, cache_dir=tmp_path / "cache").tensors
        assert rounded.keys() == exact.keys()
        for name, tensor in rounded.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, exact[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("kept_fraction", [0.001, 0.05, 0.5, 0.99])
def test_truncated_file_is_a_value_error(tmp_path, kept_fraction):
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", tiny_weights("qwen3", 16, tied=False), 16)
    content = (tmp_path / "tiny.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(content[: int(len(content) * kept_fraction)])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_gguf(truncated, torch.float32, use_cache=False)


def test_the_one_time_conversion_says_what_it_does_and_where(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tiny_weights("llama", 16, tied=False), 16)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    messages = []
    collect = logging.Handler()
    collect.emit = lambda record: messages.append(record.getMessage())
    # only this handler, whatever other tests did to the logger's handlers, level or propagation
    monkeypatch.setattr(logger, "handlers", [collect])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    entry = converted_copy(tmp_path / "tiny.gguf", write=True)
    assert converted_copy(tmp_path / "tiny.gguf", write=True) == entry  # cached: converted once
    assert len(messages) == 2, messages
    assert messages[0].startswith("converting tiny.gguf (") and str(entry) in messages[0]
    assert "PAGEDLLM_CACHE_DIR" in messages[0] and messages[1].endswith("MB on disk")
