"""Reference attention backend in plain PyTorch: runs on CPU and GPU, for any mix of prefill, chunks and decode.

The rows of decoding sequences (decode rows, speculative verify rows: past the prompt, at most ROW_WISE_MAX_QUERY
new tokens; AttentionMetadata.decoding) attend one row at a time: each such row is one batch entry of an SDPA call,
its query alone over its sequence's cached K/V gathered through the block table and padded to a length set by its
own visible length alone (padded_key_len; rows padded to the same length share a call); the query heads that share
a KV head are that head's query rows, a block of fixed size for every row. Prompt chunks attend sequence by
sequence, so a short prompt beside a long one costs no padding.

Invariant: a decoding row's output has the same bits whatever else the step holds (other sequences, their lengths,
the other rows of its own verify query, prompts beside it). CPU SDPA gives a row other bits when its query block
holds more rows or when its keys are padded to another length inside a 512-key tile (benchmarks/NOTES.md,
"Speculation changes greedy outputs"); one row per entry and a key length that is the row's own leave it nothing to
vary. That is what makes greedy speculation equal greedy decoding and batch composition change nothing on models
whose layers round activations to bfloat16 (the default model's kept GGUF blocks), where a last-bit difference can
flip a near-tied token. A prompt chunk's rows still depend on the chunk (its row count): another chunking, or a
cached prefix, can change them in the last bits.
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


# Longest query (new tokens of one sequence in a step) that attends row by row: covers decode and verify steps
# (num_speculative_tokens + 1); longer ones are prompt chunks.
ROW_WISE_MAX_QUERY = 16
# CPU SDPA folds keys in tiles of 512 (its kv split): keys padded to whole tiles give a row the same reduction order
# for any padding, since a fully masked tile adds exact zeros. Below one tile a row's keys are padded to the next
# power of two (at least MIN_KEY_PAD): a short context does not pay for 512 keys, and its length still depends on
# the row alone.
KEY_PAD = 512
MIN_KEY_PAD = 16


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [num_seqs, max_seq_len, H, D], positions in order through the block table.
    Positions past a table's width read block 0 (the caller masks them)."""
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks_needed = -(-max_seq_len // block_size)
    if num_blocks_needed > block_tables.shape[1]:
        block_tables = F.pad(block_tables, (0, num_blocks_needed - block_tables.shape[1]))
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
    flash_prompts: bool = False,
) -> torch.Tensor:
    """Causal attention of the packed queries over each sequence's cached context (new tokens already stored).
    flash_prompts: prompt chunks go to SDPA as 4-D tensors, which on CPU take its flash kernel (3-D ones its math
    path); a row's last bits differ between the two."""
    kv = (k_cache, v_cache, k_scale, v_scale)
    if metadata.decode_only:  # one row per sequence, its visible length the sequence's
        if query.device.type != "cpu":  # no host sync: CUDA graphs may capture this path (the fallback backend)
            key_len = padded_key_len(metadata.max_seq_len)
            return attend_rows(query, metadata.block_tables, metadata.seq_lens.long(), key_len, kv, scale)
        return row_wise_attention(query, metadata.block_tables, metadata.seq_lens.tolist(), kv, scale)
    out = torch.empty_like(query)
    query_start = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    decoding = metadata.decoding
    short_rows, short_positions, short_seqs = [], [], []
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start[index], query_start[index + 1]
        if start == end:  # an empty padding sequence (a step padded to a graph's shapes)
            continue
        if end - start <= ROW_WISE_MAX_QUERY and decoding is not None and decoding[index]:
            short_rows.extend(range(start, end))
            short_positions.extend(range(seq_len - (end - start), seq_len))
            short_seqs.extend([index] * (end - start))
            continue
        table = metadata.block_tables[index : index + 1]
        keys = gather_kv(k_cache, k_scale, table, seq_len, query.dtype)[0].transpose(0, 1)  # [kv_heads, len, dim]
        values = gather_kv(v_cache, v_scale, table, seq_len, query.dtype)[0].transpose(0, 1)
        queries = query[start:end].transpose(0, 1)  # [heads, rows, dim]
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None] <= query_pos[:, None]
        if flash_prompts:  # a batch of one: 4-D tensors
            queries, keys, values, visible = queries[None], keys[None], values[None], visible[None, None]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        ).reshape(-1, end - start, query.shape[-1])  # [heads, rows, dim]
        out[start:end] = attended.transpose(0, 1)
    if short_rows:
        device = query.device
        rows = torch.tensor(short_rows, device=device)
        tables = metadata.block_tables[torch.tensor(short_seqs, device=device)]  # a table row for each row
        visible = [position + 1 for position in short_positions]
        out[rows] = row_wise_attention(query[rows], tables, visible, kv, scale)
    return out


def padded_key_len(num_keys: int) -> int:
    """Keys a row with num_keys visible keys attends over: the next power of two up to KEY_PAD, whole tiles above."""
    if num_keys <= KEY_PAD:
        return max(MIN_KEY_PAD, 1 << (num_keys - 1).bit_length())
    return KEY_PAD * -(-num_keys // KEY_PAD)


def row_wise_attention(query, row_tables, visible: list[int], kv, scale):
    """query [rows, H, D]: row r attends to the first visible[r] keys through block table row_tables[r]. Rows are
    grouped by their padded key lengths, so a short row beside a long one gathers its own keys only."""
    visible_lens = torch.tensor(visible, device=query.device)
    key_lens = [padded_key_len(n) for n in visible]
    if min(key_lens) == max(key_lens):
        return attend_rows(query, row_tables, visible_lens, key_lens[0], kv, scale)
    out = torch.empty_like(query)
    for key_len in sorted(set(key_lens)):
        rows = torch.tensor([r for r, n in enumerate(key_lens) if n == key_len], device=query.device)
        out[rows] = attend_rows(query[rows], row_tables[rows], visible_lens[rows], key_len, kv, scale)
    return out


def attend_rows(query, row_tables, visible_lens, key_len: int, kv, scale):
    """Each row alone in its SDPA batch entry (the module's invariant), over key_len keys (padded_key_len's)
    gathered through its table row, the first visible_lens[r] of them visible."""
    k_cache, v_cache, k_scale, v_scale = kv
    keys = gather_kv(k_cache, k_scale, row_tables, key_len, query.dtype)  # [rows, key_len, kv_heads, dim]
    values = gather_kv(v_cache, v_scale, row_tables, key_len, query.dtype)
    visible = torch.arange(key_len, device=query.device)[None] < visible_lens[:, None]  # [rows, key_len]
    rows, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    # The query heads of one KV head (consecutive, as in enable_gqa) as that head's query rows: one fixed query
    # block per row, and no K/V repeated for the groups (bfloat16: 4x faster than enable_gqa at M = 1).
    grouped = query.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None], scale=scale
    )
    return out.reshape(rows, num_heads, head_dim)  # on CUDA, SDPA returns the heads strided


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, flash_prompts: bool = False):
        self.flash_prompts = flash_prompts  # paged_attention's

    def forward(
        self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale=None, v_scale=None
    ):
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return paged_attention(query, k_cache, v_cache, metadata, scale, k_scale, v_scale, self.flash_prompts)
