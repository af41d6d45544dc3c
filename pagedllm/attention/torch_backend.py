"""Reference attention backend in plain PyTorch: runs on CPU and GPU, for any mix of prefill, chunks and decode.

Decode steps gather every sequence's cached K/V through its block table into one padded
[num_seqs, max_seq_len] batch for a single masked SDPA call; steps with longer queries attend sequence by
sequence, so a short prompt beside a long one costs no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.fp8 import dequantize_fp8, quantize_fp8
from pagedllm.attention.metadata import AttentionMetadata


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache.view(-1, H, D)[slot] = key[token] for every token whose slot is not -1. With scale tensors
    ([num_blocks, H, block_size], fp8 caches) each (token, head) row is quantized and its scale stored too."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for rows, cache, scales in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
        if scales is None:
            cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)
        else:
            quantized, row_scales = quantize_fp8(rows)
            # Bytes through uint8 views: index_put and index_select need not support float8 on every device.
            cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots] = quantized.view(torch.uint8)
            block_size = cache.shape[1]
            scales[slots // block_size, :, slots % block_size] = row_scales


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [num_seqs, max_seq_len, H, D], positions in order through the block table."""
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks_needed = -(-max_seq_len // block_size)
    block_ids = block_tables[:, :num_blocks_needed].reshape(-1).long()
    context = cache.index_select(0, block_ids)  # index_select copies far faster than cache[tables] on CPU
    return context.view(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_seq_len]


def gather_kv(
    cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, max_seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """gather_context in dtype; an fp8 cache is dequantized with its scales ([num_blocks, H, block_size])."""
    if scales is None:
        return gather_context(cache, block_tables, max_seq_len).to(dtype)
    context = gather_context(cache.view(torch.uint8), block_tables, max_seq_len).view(cache.dtype)
    context_scales = gather_context(scales.transpose(1, 2), block_tables, max_seq_len)  # [num_seqs, len, H]
    return dequantize_fp8(context, context_scales, dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries over each sequence's cached context (new tokens already stored)."""
    attend = batched_paged_attention if metadata.decode_only else per_sequence_paged_attention
    return attend(query, k_cache, v_cache, metadata, scale, k_scale, v_scale)


def per_sequence_paged_attention(query, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale, v_scale):
    out = torch.empty_like(query)
    query_start = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start[index], query_start[index + 1]
        if start == end:  # an empty padding sequence (a step padded to a graph's shapes)
            continue
        table = metadata.block_tables[index : index + 1]
        keys = gather_kv(k_cache, k_scale, table, seq_len, query.dtype)[0].transpose(0, 1)  # [kv_heads, len, dim]
        values = gather_kv(v_cache, v_scale, table, seq_len, query.dtype)[0].transpose(0, 1)
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
        out[start:end] = attended.transpose(0, 1)
    return out


def batched_paged_attention(query, k_cache, v_cache, metadata: AttentionMetadata, scale, k_scale, v_scale):
    num_tokens = query.shape[0]
    num_seqs, max_q, max_k = metadata.num_seqs, metadata.max_query_len, metadata.max_seq_len
    device = query.device
    query_start = metadata.query_start_loc.long()
    query_lens = query_start[1:] - query_start[:-1]
    seq_lens = metadata.seq_lens.long()

    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens)
    token_row = torch.arange(num_tokens, device=device) - query_start[token_seq]
    padded_query = query.new_zeros(num_seqs, max_q, *query.shape[1:])
    padded_query[token_seq, token_row] = query

    key_pos = torch.arange(max_k, device=device)
    in_context = key_pos[None] < seq_lens[:, None]  # [num_seqs, max_k]
    # Slots past a sequence's end hold stale but finite values (the cache starts zeroed): the mask hides them.
    keys = gather_kv(k_cache, k_scale, metadata.block_tables, max_k, query.dtype)
    values = gather_kv(v_cache, v_scale, metadata.block_tables, max_k, query.dtype)

    query_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None]  # [num_seqs, max_q]
    visible = (key_pos[None, None] <= query_pos[:, :, None]) & in_context[:, None]

    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[token_seq, token_row]


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale=None, v_scale=None
    ):
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return paged_attention(query, k_cache, v_cache, metadata, scale, k_scale, v_scale)
