"""KV cache sizing and allocation: an fp8 cache holds about twice the tokens in the same bytes, scales included."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm.attention.fp8 import FP8_DTYPE
from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.executor.kv_cache import allocate_kv_cache, bind_kv_cache, choose_num_kv_blocks, kv_block_bytes, zeros
from pagedllm.models.spec import DecoderSpec

SPEC = DecoderSpec(
    architecture="Qwen3ForCausalLM", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_block_bytes_count_every_allocated_byte(kv_cache_dtype):
    cache = allocate_kv_cache(SPEC, 5, 16, torch.bfloat16, torch.device("cpu"), 1, kv_cache_dtype)
    tensors = (cache.keys, cache.values, cache.key_scales, cache.value_scales)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert num_bytes == 5 * kv_block_bytes(SPEC, 16, torch.bfloat16, 1, kv_cache_dtype)
    assert cache.keys.shape == cache.values.shape == (3, 5, 16, 2, 128)
    if kv_cache_dtype == "fp8":
        assert cache.keys.dtype == torch.float8_e4m3fn
        assert cache.key_scales.shape == cache.value_scales.shape == (3, 5, 2, 16)
    else:
        assert cache.keys.dtype == torch.bfloat16 and cache.key_scales is None


def test_fp8_holds_about_twice_the_tokens_of_bf16_in_the_same_bytes():
    config = EngineConfig(kv_cache_memory_bytes=64 << 20)
    blocks = {
        name: choose_num_kv_blocks(config, kv_block_bytes(SPEC, 16, torch.bfloat16, 1, name), 4096, torch.device("cpu"))
        for name in ("auto", "fp8")
    }
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(2 * 128 / (128 + 4), rel=0.01)  # 4-byte scale per head


def test_bind_gives_each_layer_its_slice_and_scales():
    layers = torch.nn.ModuleList(Attention(4, 2, 128, 1.0) for _ in range(3))
    cache = allocate_kv_cache(SPEC, 2, 16, torch.float32, torch.device("cpu"), 1, "fp8")
    bind_kv_cache(layers, cache, backend="backend")
    for index, layer in enumerate(layers):
        assert layer.k_cache.data_ptr() == cache.keys[index].data_ptr() and layer.backend == "backend"
        assert layer.v_scale.data_ptr() == cache.value_scales[index].data_ptr()
    bind_kv_cache(layers, allocate_kv_cache(SPEC, 2, 16, torch.float32, torch.device("cpu"), 1), backend="backend")
    assert all(layer.k_scale is None and layer.v_scale is None for layer in layers)


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_a_cpu_cache_is_zeroed_writable_memory_that_its_views_keep_alive(dtype):
    cache = zeros((2, 3, 16, 2, 8), dtype, torch.device("cpu"))
    assert cache.shape == (2, 3, 16, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.view(torch.uint8).any()
    layer = cache[1]
    del cache
    gc.collect()
    layer.view(torch.uint8).fill_(7)  # the map outlives the tensor it was made for, while a view holds it
    assert layer.view(torch.uint8).eq(7).all()
    assert zeros((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


@pytest.mark.parametrize(
    "free_bytes, max_num_seqs, expected_bytes",
    [
        (64 << 30, 256, 4 << 30),  # much free memory: vLLM's CPU default, 4 GiB
        (10 << 30, 256, 2 << 30),  # less: a fifth of it
        (64 << 30, 2, 2 * 2048 * 49152),  # a full batch needs less: that (2 sequences of 2,048 blocks)
    ],
)
def test_the_cpu_default_is_a_share_of_free_memory_at_most_4_gib(monkeypatch, free_bytes, max_num_seqs, expected_bytes):
    monkeypatch.setattr("pagedllm.executor.kv_cache.available_cpu_memory", lambda: free_bytes)
    block_bytes = kv_block_bytes(SPEC, 16, torch.bfloat16, 1, "auto")
    assert block_bytes == 49152  # K and V x 3 layers x 16 tokens x 2 heads x 128 dims x 2 bytes
    config = EngineConfig(max_num_seqs=max_num_seqs)
    blocks = choose_num_kv_blocks(config, block_bytes, 32768, torch.device("cpu"))
    assert blocks == expected_bytes // block_bytes
