"""The torch and cpu backends' invariant: a decode or verify row's attention output has the same bits whatever else
its step holds. CPU SDPA alone gives a row other bits when its batch is padded to a longer sequence or when its query
block holds more rows; on a model whose layers round activations to bfloat16 that flips near-tied greedy tokens, so
speculation and batch composition would change greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import cpu_kernels
from pagedllm.attention import cpu_backend, torch_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import ROW_WISE_MAX_QUERY

BACKENDS = {"torch": torch_backend.paged_attention, "cpu": cpu_backend.paged_attention}

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# Each sequence's context after the step; "small" and "near" pad to the same 128 keys, "target" and "mid" to 512.
CONTEXTS = {"target": 300, "long": 1500, "short": 7, "prompt": 90, "small": 100, "near": 120, "mid": 470}


class PagedCache:
    """Random K/V for every position of four sequences, each in its own shuffled blocks."""

    def __init__(self, dtype: torch.dtype, generator: torch.Generator, backend: str = "torch"):
        if backend == "cpu":
            cpu_kernels.require()
        self.attention = BACKENDS[backend]
        self.blocks_per_seq = -(-max(CONTEXTS.values()) // BLOCK_SIZE)
        num_blocks = len(CONTEXTS) * self.blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=generator).to(dtype)
        self.v_cache = torch.randn(shape, generator=generator).to(dtype)
        order = torch.randperm(num_blocks, generator=generator).int()
        self.tables = dict(zip(CONTEXTS, order.view(len(CONTEXTS), -1)))
        self.queries = {name: torch.randn(n, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
                        for name, n in CONTEXTS.items()}  # fmt: skip

    def step(self, query_lens: dict[str, int]) -> torch.Tensor:
        """Attention output of one step: sequence `name` computes its last query_lens[name] positions."""
        names = list(query_lens)
        lens = [query_lens[name] for name in names]
        seq_lens = [CONTEXTS[name] for name in names]
        query = torch.cat([self.queries[name][CONTEXTS[name] - n :] for name, n in query_lens.items()])
        metadata = AttentionMetadata(
            slot_mapping=torch.full((sum(lens),), -1),
            query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.stack([self.tables[name] for name in names]),
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            decode_only=all(n == 1 for n in lens),
            decoding=np.array([name != "prompt" for name in names], np.int32),  # the rest decode or verify
        )
        return self.attention(query, self.k_cache, self.v_cache, metadata, HEAD_DIM**-0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_change_with_the_rest_of_its_step(dtype, backend):
    cache = PagedCache(dtype, torch.Generator().manual_seed(0), backend)
    alone = cache.step({"target": 1})
    steps = {
        "decode beside a longer and a shorter sequence": (cache.step({"short": 1, "target": 1, "long": 1}), 1),
        "the last row of a verify query": (cache.step({"target": 4, "long": 1}), 3),
        "the last row of the longest verify query": (cache.step({"long": 1, "target": ROW_WISE_MAX_QUERY}), 16),
        "decode beside a prompt chunk": (cache.step({"prompt": 40, "target": 1}), 40),
    }
    for what, (out, row) in steps.items():
        assert torch.equal(out[row], alone[0]), what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_rows_bits_do_not_change_beside_rows_padded_alike_or_not(dtype, backend):
    """Below one 512-key tile a row's keys are padded to a power of two; a row sharing its call with another of the
    same padded length, or beside rows of other lengths, keeps the bits it has alone."""
    cache = PagedCache(dtype, torch.Generator().manual_seed(2), backend)
    alone = cache.step({"small": 1})
    steps = {
        "beside a row padded to the same length": (cache.step({"near": 1, "small": 1}), 1),
        "beside rows of other lengths": (cache.step({"short": 1, "mid": 1, "small": 1, "long": 1}), 2),
        "the last row of a verify query, its rows padded alike": (cache.step({"small": 5, "near": 1}), 4),
        "beside a prompt chunk": (cache.step({"prompt": 30, "small": 1}), 30),
    }
    for what, (out, row) in steps.items():
        assert torch.equal(out[row], alone[0]), what


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_are_the_attention_they_stand_for(backend):
    """Row-wise attention is still attention: each row against one SDPA call over exactly its visible keys."""
    cache = PagedCache(torch.float32, torch.Generator().manual_seed(1), backend)
    out = cache.step({"short": 1, "target": 4, "prompt": 40, "long": 1, "small": 3})
    rows = [("short", 6), *(("target", p) for p in range(296, 300)), *(("prompt", p) for p in range(50, 90)),
            ("long", 1499), *(("small", p) for p in range(97, 100))]  # fmt: skip
    for row, (name, position) in enumerate(rows):
        slots = torch.arange(position + 1)
        blocks = cache.tables[name][slots // BLOCK_SIZE].long()
        keys = cache.k_cache[blocks, slots % BLOCK_SIZE].transpose(0, 1)  # [kv_heads, len, dim]
        values = cache.v_cache[blocks, slots % BLOCK_SIZE].transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            cache.queries[name][position][:, None], keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_change_with_the_thread_count():
    """The cpu backend's kernel splits rows (or a row's KV heads) over threads; each is computed by one thread."""
    cache = PagedCache(torch.float32, torch.Generator().manual_seed(3), "cpu")
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(cache.step({"short": 1, "target": 4, "long": 1}))
            outputs.append(cache.step({"target": 1}))
    finally:
        torch.set_num_threads(threads)
    for out in outputs[2::2]:
        assert torch.equal(out, outputs[0])
    for out in outputs[3::2]:
        assert torch.equal(out, outputs[1])
