"""The torch backend's two kernels for prompt chunks on CPU (KernelChoices.torch_prompt_sdpa): SDPA's math path and
its flash kernel both give causal attention over the cached context, a chunk's rows beside a decode row;
flash_prompts keeps the chunk off the math path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 32, 16


class OpsCalled(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def reference(query, keys, values, first_position):
    """float64 causal attention of query rows at positions first_position.. over keys/values [len, kv_heads, dim]."""
    group = HEADS // KV_HEADS
    q = query.double().transpose(0, 1)
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * DIM**-0.5
    positions = torch.arange(first_position, first_position + len(query))
    scores.masked_fill_(torch.arange(len(keys))[None] > positions[:, None], -torch.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


def step(seq_lens, query_lens, dtype, generator):
    num_seqs, blocks_per_seq = len(seq_lens), -(-max(seq_lens) // BLOCK)
    shape = (num_seqs * blocks_per_seq, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=generator).int().view(num_seqs, -1)
    query = torch.randn(sum(query_lens), HEADS, DIM, generator=generator).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1),
        query_start_loc=torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        decode_only=False,
        decoding=np.array([int(q == 1) for q in query_lens], np.int32),
    )
    return query, k_cache, v_cache, tables, metadata


@pytest.mark.parametrize("flash_prompts", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens, query_lens",
    [
        ([70, 45], [30, 1]),  # a chunk of 30 after 40 cached tokens; a decode row
        ([37, 70, 45], [37, 30, 1]),  # a whole prompt (no cached context: is_causal) beside them
    ],
)
def test_prompt_chunks_beside_a_decode_row(flash_prompts, dtype, seq_lens, query_lens):
    generator = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, tables, metadata = step(seq_lens, query_lens, dtype, generator)
    with OpsCalled() as ops:
        out = paged_attention(query, k_cache, v_cache, metadata, DIM**-0.5, flash_prompts=flash_prompts)
    # The decode row takes the flash kernel either way; only the math path computes a softmax of its own.
    assert ("_safe_softmax" in ops.names) != flash_prompts
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    start = 0
    for index, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        keys, values = (cache[tables[index].long()].flatten(0, 1)[:seq_len] for cache in (k_cache, v_cache))
        expected = reference(query[start : start + query_len], keys, values, seq_len - query_len)
        torch.testing.assert_close(out[start : start + query_len].double(), expected, atol=tolerance, rtol=tolerance)
        start += query_len


@pytest.mark.parametrize("flash_prompts", [False, True])
def test_a_whole_prompt_takes_is_causal_with_the_masks_bits(flash_prompts):
    """A chunk with no cached context goes to SDPA with is_causal (the flash kernel then skips the key tiles past
    each query tile); its output has the bits of the same chunk under an explicit causal mask."""
    generator = torch.Generator().manual_seed(1)
    query, k_cache, v_cache, tables, metadata = step([600], [600], torch.float32, generator)
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def masked_instead(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append(is_causal)
        if is_causal:
            attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    out = paged_attention(query, k_cache, v_cache, metadata, DIM**-0.5, flash_prompts=flash_prompts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", masked_instead)
        masked = paged_attention(query, k_cache, v_cache, metadata, DIM**-0.5, flash_prompts=flash_prompts)
    assert calls == [True]
    assert torch.equal(out, masked)
