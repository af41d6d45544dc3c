"""The cpu backend (decode and verify rows attended in place by attention/cpu_paged_attention.cpp) against the torch
backend, its oracle, on random paged layouts: block sizes 1-64, GQA groups 1-8, head_dims 64-128 and one that is no
multiple of 8, permuted block tables with unused entries, decode-only steps and steps mixing decode rows, verify rows
and prompt chunks over cached context; float32, bfloat16 and float16 caches and fp8 caches under float32 and
bfloat16 queries."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.fp8 import FP8_DTYPE
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend, store_kv_cache

# (query dtype, cache dtype, tolerance): the kernel sums in float32; the reference attends in the queries' dtype
# (and rounds an fp8 cache's values to it first), so 16-bit rows agree to that dtype's rounding.
CASES = {
    "float32": (torch.float32, torch.float32, 1e-5),
    "bfloat16": (torch.bfloat16, torch.bfloat16, 2e-2),
    "float16": (torch.float16, torch.float16, 4e-3),
    "fp8, float32 queries": (torch.float32, FP8_DTYPE, 1e-5),
    "fp8, bfloat16 queries": (torch.bfloat16, FP8_DTYPE, 2e-2),
}
SHAPES = [  # (block_size, query heads, KV heads, head_dim)
    (16, 9, 3, 64),
    (1, 8, 1, 64),
    (64, 32, 4, 128),
    (8, 4, 4, 72),
    (32, 16, 2, 100),
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    cpu_kernels.require()


def random_step(generator, block_size, num_heads, num_kv_heads, head_dim, decode_only):
    """Sequences with random cached contexts in shuffled blocks (tables wider than they need), each computing 1 new
    token (decode), 2-5 (verify) or 6-40 (a prompt chunk over its cached context); the step's new K/V."""
    num_seqs = int(torch.randint(1, 7, (1,), generator=generator))
    contexts = torch.randint(1, 300, (num_seqs,), generator=generator).tolist()
    if decode_only:
        query_lens = [1] * num_seqs
    else:
        choices = [
            1,
            int(torch.randint(2, 6, (1,), generator=generator)),
            int(torch.randint(6, 41, (1,), generator=generator)),
        ]
        query_lens = [choices[int(torch.randint(0, 3, (1,), generator=generator))] for _ in range(num_seqs)]
    seq_lens = [context + n for context, n in zip(contexts, query_lens)]
    width = max(-(-n // block_size) for n in seq_lens) + 2  # entries past each sequence's end are unused
    num_blocks = num_seqs * width + 3
    block_tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * width].view(num_seqs, width).int()
    slot = lambda seq, pos: int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
    slot_mapping = torch.tensor([slot(s, p) for s, n in enumerate(seq_lens) for p in range(n - query_lens[s], n)])
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_only=decode_only,
        decoding=None if decode_only else np.array([n <= 5 for n in query_lens], np.int32),
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    tokens = sum(query_lens)
    query = torch.randn(tokens, num_heads, head_dim, generator=generator)
    key, value = (torch.randn(tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    history = [torch.randn(cache_shape, generator=generator) * 2 for _ in range(2)]  # the cached contexts
    return query, key, value, history, metadata


def run(backend, query, key, value, history, metadata, query_dtype, cache_dtype):
    """backend.forward on caches holding `history` (stored through the torch backend's store, fp8 with scales)."""
    num_blocks, block_size, num_kv_heads, _ = history[0].shape
    caches = [torch.zeros(history[0].shape, dtype=cache_dtype) for _ in range(2)]
    scales = (
        [torch.zeros(num_blocks, num_kv_heads, block_size) for _ in range(2)]
        if cache_dtype == FP8_DTYPE
        else [None, None]
    )
    all_slots = torch.arange(num_blocks * block_size)
    flat = [h.view(-1, *h.shape[2:]).to(query_dtype) for h in history]
    store_kv_cache(*flat, *caches, all_slots, *scales)
    metadata.derived.clear()  # each backend derives its own layout
    return backend.forward(
        query.to(query_dtype), key.to(query_dtype), value.to(query_dtype), *caches, metadata,
        query.shape[-1] ** -0.5, *scales,
    ), caches  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"bs{s[0]}-h{s[1]}/{s[2]}-d{s[3]}")
def test_the_cpu_backend_attends_as_the_torch_backend(case, shape):
    query_dtype, cache_dtype, tolerance = CASES[case]
    generator = torch.Generator().manual_seed(zlib.crc32(repr((case, shape)).encode()))
    for trial in range(6):
        step = random_step(generator, *shape, decode_only=trial % 3 == 0)
        expected, expected_caches = run(TorchAttentionBackend(), *step, query_dtype, cache_dtype)
        out, caches = run(CpuAttentionBackend(), *step, query_dtype, cache_dtype)
        for cache, expected_cache in zip(caches, expected_caches):  # the same store: the same bytes
            assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
        assert out.dtype == query_dtype and out.shape == expected.shape
        scale = expected.float().abs().max().item()
        assert (out.float() - expected.float()).abs().max().item() <= tolerance * max(scale, 1.0), trial


def test_wrong_inputs_are_refused_with_what_is_allowed():
    query = torch.randn(2, 4, 64)
    cache = torch.zeros(3, 16, 2, 64)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    kernel = torch.ops.pagedllm_cpu.paged_attention_rows
    with pytest.raises(RuntimeError, match="past its block table"):
        kernel(query, cache, cache, tables, None, torch.tensor([5, 33], dtype=torch.int32), 0.1, None, None)
    with pytest.raises(RuntimeError, match="the cache holds the queries' dtype or fp8"):
        kernel(query, cache.bfloat16(), cache.bfloat16(), tables, None, torch.tensor([1, 1], dtype=torch.int32), 0.1,
               None, None)  # fmt: skip
    with pytest.raises(RuntimeError, match="scales come with an fp8 cache"):
        kernel(query, cache, cache, tables, None, torch.tensor([1, 1], dtype=torch.int32), 0.1, cache, cache)
