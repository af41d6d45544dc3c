"""The fp8 KV cache on the torch backend: quantization error bounds, the cache round trip, attention over it."""

from __future__ import annotations

import torch

from pagedllm.attention.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend, gather_kv, paged_attention, store_kv_cache

HALF_ULP = 2.0**-4  # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of it


def rows_of_every_magnitude(generator: torch.Generator) -> torch.Tensor:
    """[200 tokens, 4 heads, 80 dims]: row maxima from 1e-6 to 1e4, one outlier per row, an all-zero row."""
    rows = torch.randn(200, 4, 80, generator=generator) * torch.logspace(-6, 4, 200)[:, None, None]
    rows[:, :, 7] *= 30  # an outlier dimension, as real keys have
    rows[0, 1] = 0
    return rows


def test_quantize_keeps_every_value_within_fp8_rounding():
    rows = rows_of_every_magnitude(torch.Generator().manual_seed(0))
    values, scales = quantize_fp8(rows)
    assert values.dtype == FP8_DTYPE and scales.shape == rows.shape[:-1]
    assert torch.equal(scales, 2.0 ** scales.log2().round()), "scales are powers of two"
    amax = rows.abs().amax(-1)
    used = amax[amax > 0] / scales[amax > 0]
    assert used.max() <= FP8_MAX and used.min() > FP8_MAX / 2, "each row's largest value uses the top binade"
    restored = dequantize_fp8(values, scales, torch.float32)
    error = (restored - rows).abs()
    in_normal_range = rows.abs() >= 2.0**-6 * scales[..., None]
    assert (error[in_normal_range] <= HALF_ULP * rows.abs()[in_normal_range]).all()
    assert (error <= 2.0**-10 * scales[..., None] + HALF_ULP * rows.abs()).all()  # subnormals: half of 2^-9
    assert (restored[0, 1] == 0).all()


def paged_step(generator, query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=80, block_size=8):
    """A step over fresh blocks: each sequence's first seq_len - query_len positions are written beforehand."""
    num_seqs = len(seq_lens)
    blocks_per_seq = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.randperm(num_seqs * blocks_per_seq, generator=generator).view(num_seqs, -1).int()
    positions = [range(seq_len - query_len, seq_len) for query_len, seq_len in zip(query_lens, seq_lens)]
    slot_of = lambda seq, pos: int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
    slot_mapping = torch.tensor([slot_of(seq, pos) for seq, poss in enumerate(positions) for pos in poss])
    cached_slots = torch.tensor([slot_of(seq, pos) for seq, n in enumerate(seq_lens) for pos in range(n)])
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
    decode_only = all(n == 1 for n in query_lens)
    metadata = AttentionMetadata(slot_mapping, query_start_loc, seq_lens_tensor, block_tables, max(query_lens),
                                 max(seq_lens), decode_only)  # fmt: skip
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 3 for _ in range(2))
    cache_shape = (num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
    return query, key, value, metadata, cache_shape, cached_slots


def fp8_cache(cache_shape):
    num_blocks, block_size, num_kv_heads, _ = cache_shape
    caches = [torch.zeros(cache_shape, dtype=FP8_DTYPE) for _ in range(2)]
    scales = [torch.zeros(num_blocks, num_kv_heads, block_size) for _ in range(2)]
    return caches, scales


def test_cache_round_trips_key_and_value_within_fp8_error():
    generator = torch.Generator().manual_seed(1)
    query, key, value, metadata, cache_shape, _ = paged_step(generator, [5, 11], [5, 11])
    (k_cache, v_cache), (k_scale, v_scale) = fp8_cache(cache_shape)
    store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    for new, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        context = gather_kv(cache, scales, metadata.block_tables, metadata.max_seq_len, torch.float32)
        restored = torch.cat([context[0, :5], context[1, :11]])
        assert torch.equal(restored, dequantize_fp8(*quantize_fp8(new), torch.float32))
        row_max = new.abs().amax(-1, keepdim=True)
        assert ((restored - new).abs() <= HALF_ULP * new.abs() + 2.0**-13 * row_max).all()


def test_attention_over_an_fp8_cache_is_attention_over_its_dequantized_values():
    """A mixed step (decode, prefix hit, fresh prefill) and a decode-only step: the fp8 path equals the float path
    on a float cache holding the same dequantized values, and stays near the unquantized result."""
    generator = torch.Generator().manual_seed(2)
    for query_lens, seq_lens in (([1, 6, 9], [13, 20, 9]), ([1, 1, 1], [30, 4, 17])):
        query, key, value, metadata, cache_shape, cached_slots = paged_step(generator, query_lens, seq_lens)
        history = [torch.randn(len(cached_slots), *cache_shape[2:], generator=generator) for _ in range(2)]
        (k_cache, v_cache), (k_scale, v_scale) = fp8_cache(cache_shape)
        store_kv_cache(*history, k_cache, v_cache, cached_slots, k_scale, v_scale)
        out = TorchAttentionBackend().forward(
            query, key, value, k_cache, v_cache, metadata, 80**-0.5, k_scale=k_scale, v_scale=v_scale
        )
        caches_and_scales = ((k_cache, k_scale), (v_cache, v_scale))
        # The forward stored the new tokens too: the whole context is in the fp8 cache now.
        k_float, v_float = (dequantize_fp8(c, s.transpose(1, 2), torch.float32) for c, s in caches_and_scales)
        expected = paged_attention(query, k_float, v_float, metadata, 80**-0.5)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        float_caches = [torch.zeros(cache_shape) for _ in range(2)]
        store_kv_cache(*history, *float_caches, cached_slots)
        unquantized = TorchAttentionBackend().forward(query, key, value, *float_caches, metadata, 80**-0.5)
        assert (out - unquantized).norm() / unquantized.norm() < 0.08  # 0.045 and 0.039 here
