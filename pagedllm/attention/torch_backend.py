"""Reference attention backend in plain PyTorch: runs on CPU and GPU, for any mix of prefill, chunks and decode.

Decode steps gather every sequence's cached K/V through its block table into one padded
[num_seqs, max_seq_len] batch for a single masked SDPA call; steps with longer queries attend sequence by
sequence, so a short prompt beside a long one costs no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache.view(-1, H, D)[slot] = key[token] for every token whose slot is not -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [num_seqs, max_seq_len, H, D], positions in order through the block table."""
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks_needed = -(-max_seq_len // block_size)
    block_ids = block_tables[:, :num_blocks_needed].reshape(-1).long()
    context = cache.index_select(0, block_ids)  # index_select copies far faster than cache[tables] on CPU
    return context.view(num_seqs, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_seq_len]


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the packed queries over each sequence's cached context (new tokens already stored)."""
    if metadata.decode_only:
        return batched_paged_attention(query, k_cache, v_cache, metadata, scale)
    return per_sequence_paged_attention(query, k_cache, v_cache, metadata, scale)


def per_sequence_paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    out = torch.empty_like(query)
    query_start = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start[index], query_start[index + 1]
        table = metadata.block_tables[index : index + 1]
        keys = gather_context(k_cache, table, seq_len)[0].to(query.dtype).transpose(0, 1)  # [kv_heads, len, dim]
        values = gather_context(v_cache, table, seq_len)[0].to(query.dtype).transpose(0, 1)
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
        out[start:end] = attended.transpose(0, 1)
    return out


def batched_paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
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
    keys = gather_context(k_cache, metadata.block_tables, max_k).to(query.dtype)
    values = gather_context(v_cache, metadata.block_tables, max_k).to(query.dtype)

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

    def forward(self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        return paged_attention(query, k_cache, v_cache, metadata, scale)
