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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.fp8 import dequantize_fp8, quantize_fp8
from pagedllm.attention.metadata import AttentionMetadata


def kept_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the rows whose slot is not -1, or None when every row stores; their slots)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping[rows]


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kept: tuple[torch.Tensor | None, torch.Tensor] | None = None,
) -> None:
    """k_cache.view(-1, H, D)[slot] = key[token] for every token whose slot is not -1. With scale tensors
    ([num_blocks, H, block_size], fp8 caches) each (token, head) row is quantized and its scale stored too.
    kept: kept_slots(slot_mapping), where the caller has it already (every layer of a step stores the same rows)."""
    rows, slots = kept if kept is not None else kept_slots(slot_mapping)
    if rows is not None:
        key, value = key[rows], value[rows]
    for new, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if scales is None:
            cache.view(-1, *cache.shape[2:])[slots] = new if new.dtype == cache.dtype else new.to(cache.dtype)
        else:
            quantized, row_scales = quantize_fp8(new)
            # Bytes through uint8 views: index_put and index_select need not support float8 on every device.
            cache.view(torch.uint8).view(-1, *cache.shape[2:])[slots] = quantized.view(torch.uint8)
            block_size = cache.shape[1]
            scales[slots // block_size, :, slots % block_size] = row_scales


# Longest query (new tokens of one sequence in a step) that attends row by row: covers decode and verify steps
# (num_speculative_tokens + 1); longer ones are prompt chunks.
ROW_WISE_MAX_QUERY = 16


def decodes(metadata: AttentionMetadata, index: int, num_new: int) -> bool:
    """Whether sequence `index`'s num_new rows of the step are decoding rows (decode, verify: past its prompt, at
    most ROW_WISE_MAX_QUERY), attended row by row; else they are a prompt chunk. Every backend splits a step so."""
    return num_new <= ROW_WISE_MAX_QUERY and metadata.decoding is not None and bool(metadata.decoding[index])


# CPU SDPA folds keys in tiles of 512 (its kv split): keys padded to whole tiles give a row the same reduction order
# for any padding, since a fully masked tile adds exact zeros. Below one tile a row's keys are padded to the next
# power of two (at least MIN_KEY_PAD): a short context does not pay for 512 keys, and its length still depends on
# the row alone.
KEY_PAD = 512
MIN_KEY_PAD = 16


def context_block_ids(block_tables: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """The cache blocks holding each table row's first num_positions positions, in order, flattened (int64).
    Positions past a table's width read block 0 (the caller masks them)."""
    num_blocks_needed = -(-num_positions // block_size)
    if num_blocks_needed > block_tables.shape[1]:
        block_tables = F.pad(block_tables, (0, num_blocks_needed - block_tables.shape[1]))
    return block_tables[:, :num_blocks_needed].reshape(-1).long()


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, num_positions: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [num_seqs, num_positions, H, D] through context_block_ids' ids."""
    context = cache.index_select(0, block_ids)  # index_select copies far faster than cache[tables] on CPU
    return context.view(num_seqs, -1, *cache.shape[2:])[:, :num_positions]


def gather_kv(
    cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, max_seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [num_seqs, max_seq_len, H, D] in dtype, positions in order through the block
    table; an fp8 cache is dequantized with its scales ([num_blocks, H, block_size])."""
    block_ids = context_block_ids(block_tables, max_seq_len, cache.shape[1])
    return gather_kv_blocks(cache, scales, block_ids, block_tables.shape[0], max_seq_len, dtype)


def gather_kv_blocks(cache, scales, block_ids: torch.Tensor, num_seqs: int, num_positions: int, dtype: torch.dtype):
    """gather_blocks in dtype; an fp8 cache is dequantized with its scales."""
    if scales is None:
        context = gather_blocks(cache, block_ids, num_seqs, num_positions)
        return context if context.dtype == dtype else context.to(dtype)
    context = gather_blocks(cache.view(torch.uint8), block_ids, num_seqs, num_positions).view(cache.dtype)
    context_scales = gather_blocks(scales.transpose(1, 2), block_ids, num_seqs, num_positions)  # [seqs, len, H]
    return dequantize_fp8(context, context_scales, dtype)


@dataclass(slots=True)
class RowGroup:
    """Rows of decoding sequences whose keys pad to one length: their block ids and visibility mask."""

    rows: torch.Tensor | None  # the group's rows among the rows attended, None: all of them, in order
    block_ids: torch.Tensor  # context_block_ids of the rows' tables for key_len positions
    key_len: int
    visible: torch.Tensor  # [rows, 1, 1, key_len] bool: the first visible_len keys of each row


@dataclass(slots=True)
class PromptChunk:
    """A sequence's new tokens attended together: its rows, block ids for its context and causal mask."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor
    visible: torch.Tensor | None  # [rows, seq_len] bool; None: no cached context, the rows are the keys (causal)


@dataclass(slots=True)
class StepLayout:
    """How a step's rows attend, derived once from its metadata and shared by every layer (a step's metadata is
    the same in each): prompt chunks sequence by sequence, the rows of decoding sequences one at a time in groups."""

    chunks: list[PromptChunk]
    short_rows: torch.Tensor | None  # the rows attended one at a time, None: every row (a decode-only step)
    groups: list[RowGroup]


def padded_key_len(num_keys: int) -> int:
    """Keys a row with num_keys visible keys attends over: the next power of two up to KEY_PAD, whole tiles above."""
    if num_keys <= KEY_PAD:
        return max(MIN_KEY_PAD, 1 << (num_keys - 1).bit_length())
    return KEY_PAD * -(-num_keys // KEY_PAD)


def row_group(rows, tables: torch.Tensor, visible_lens: torch.Tensor, key_len: int, block_size: int) -> RowGroup:
    visible = torch.arange(key_len, device=tables.device)[None] < visible_lens[:, None]
    return RowGroup(rows, context_block_ids(tables, key_len, block_size), key_len, visible[:, None, None])


def row_groups(row_tables: torch.Tensor, visible: list[int], block_size: int) -> list[RowGroup]:
    """Row r attends to the first visible[r] keys through block table row_tables[r]. Rows are grouped by their
    padded key lengths, so a short row beside a long one gathers its own keys only."""
    device = row_tables.device
    key_lens = [padded_key_len(n) for n in visible]
    visible_lens = torch.tensor(visible, device=device)
    if min(key_lens) == max(key_lens):
        return [row_group(None, row_tables, visible_lens, key_lens[0], block_size)]
    groups = []
    for key_len in sorted(set(key_lens)):
        rows = torch.tensor([r for r, n in enumerate(key_lens) if n == key_len], device=device)
        groups.append(row_group(rows, row_tables[rows], visible_lens[rows], key_len, block_size))
    return groups


@dataclass(slots=True)
class StepRows:
    """A step's rows split by how they attend: prompt chunks, and the rows of decoding sequences (each with the
    keys it sees and its sequence's index) attended one at a time."""

    chunks: list[PromptChunk]
    short_rows: list[int]
    short_visible: list[int]
    short_seqs: list[int]


def split_rows(metadata: AttentionMetadata, block_size: int) -> StepRows:
    """The rows of decoding sequences (decode rows, verify rows: at most ROW_WISE_MAX_QUERY new tokens, past the
    prompt) one at a time; every other sequence's new tokens as one prompt chunk."""
    device = metadata.block_tables.device
    query_start = metadata.query_start_loc.tolist()
    split = StepRows([], [], [], [])
    for index, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = query_start[index], query_start[index + 1]
        if start == end:  # an empty padding sequence (a step padded to a graph's shapes)
            continue
        if decodes(metadata, index, end - start):
            split.short_rows.extend(range(start, end))
            split.short_visible.extend(range(seq_len - (end - start) + 1, seq_len + 1))
            split.short_seqs.extend([index] * (end - start))
            continue
        block_ids = context_block_ids(metadata.block_tables[index : index + 1], seq_len, block_size)
        visible = None
        if seq_len > end - start:  # keys cached before the chunk: SDPA's is_causal would align them to its first row
            query_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
            visible = torch.arange(seq_len, device=device)[None] <= query_pos[:, None]
        split.chunks.append(PromptChunk(start, end, seq_len, block_ids, visible))
    return split


def step_layout(metadata: AttentionMetadata, block_size: int) -> StepLayout:
    """split_rows, the short rows grouped by padded key length (row_groups)."""
    if metadata.decode_only:  # one row per sequence, its visible length the sequence's
        return StepLayout([], None, row_groups(metadata.block_tables, metadata.seq_lens.tolist(), block_size))
    split = split_rows(metadata, block_size)
    if not split.short_rows:
        return StepLayout(split.chunks, None, [])
    device = metadata.block_tables.device
    tables = metadata.block_tables[torch.tensor(split.short_seqs, device=device)]  # a table row for each row
    groups = row_groups(tables, split.short_visible, block_size)
    return StepLayout(split.chunks, torch.tensor(split.short_rows, device=device), groups)


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
    if metadata.decode_only and query.device.type != "cpu":  # no host sync on CUDA: one group, the longest's keys
        key_len, block_size = padded_key_len(metadata.max_seq_len), k_cache.shape[1]
        group = row_group(None, metadata.block_tables, metadata.seq_lens.long(), key_len, block_size)
        return attend_rows(query, group, kv, scale)
    layout = metadata.once("torch_backend.layout", lambda: step_layout(metadata, k_cache.shape[1]))
    if layout.short_rows is None and not layout.chunks:
        return row_wise_attention(query, layout.groups, kv, scale)
    out = torch.empty_like(query)
    attend_chunks(query, layout.chunks, kv, scale, flash_prompts, out)
    if layout.short_rows is not None:
        out[layout.short_rows] = row_wise_attention(query[layout.short_rows], layout.groups, kv, scale)
    return out


def attend_chunks(query, chunks: list[PromptChunk], kv, scale: float, flash_prompts: bool, out: torch.Tensor) -> None:
    """out[chunk rows] = each prompt chunk's causal attention over its sequence's context, gathered (one copy of
    that sequence's context, small beside the chunk's products)."""
    k_cache, v_cache, k_scale, v_scale = kv
    for chunk in chunks:
        keys, values = (
            gather_kv_blocks(cache, scales, chunk.block_ids, 1, chunk.seq_len, query.dtype)[0].transpose(0, 1)
            for cache, scales in ((k_cache, k_scale), (v_cache, v_scale))
        )  # [kv_heads, len, dim]
        queries, visible = query[chunk.start : chunk.end].transpose(0, 1), chunk.visible  # [heads, rows, dim]
        if flash_prompts:  # a batch of one: 4-D tensors
            queries, keys, values = queries[None], keys[None], values[None]
            visible = None if visible is None else visible[None, None]
        # is_causal skips the key tiles past each query tile (the flash kernel); a mask computes them: same bits
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, is_causal=visible is None, scale=scale, enable_gqa=True
        ).reshape(-1, chunk.end - chunk.start, query.shape[-1])  # [heads, rows, dim]
        out[chunk.start : chunk.end] = attended.transpose(0, 1)


def row_wise_attention(query, groups: list[RowGroup], kv, scale):
    """query [rows, H, D], each row attended alone by its group (row_groups)."""
    if len(groups) == 1 and groups[0].rows is None:
        return attend_rows(query, groups[0], kv, scale)
    out = torch.empty_like(query)
    for group in groups:
        out[group.rows] = attend_rows(query[group.rows], group, kv, scale)
    return out


def attend_rows(query, group: RowGroup, kv, scale):
    """Each row alone in its SDPA batch entry (the module's invariant), over the group's key_len keys gathered
    through its block ids, the visible ones unmasked."""
    k_cache, v_cache, k_scale, v_scale = kv
    rows, num_heads, head_dim = query.shape
    keys = gather_kv_blocks(k_cache, k_scale, group.block_ids, rows, group.key_len, query.dtype)
    values = gather_kv_blocks(v_cache, v_scale, group.block_ids, rows, group.key_len, query.dtype)
    num_kv_heads = keys.shape[2]  # keys [rows, key_len, kv_heads, dim]
    # The query heads of one KV head (consecutive, as in enable_gqa) as that head's query rows: one fixed query
    # block per row, and no K/V repeated for the groups (bfloat16: 4x faster than enable_gqa at M = 1).
    grouped = query.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.visible, scale=scale
    )
    return out.reshape(rows, num_heads, head_dim)  # on CUDA, SDPA returns the heads strided


class TorchAttentionBackend:
    name = "torch"
    attend = staticmethod(paged_attention)  # after the store; the cpu backend puts its own here

    def __init__(self, flash_prompts: bool = False):
        self.flash_prompts = flash_prompts  # attend's

    def forward(
        self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale=None, v_scale=None
    ):
        kept = metadata.once("torch_backend.kept_slots", lambda: kept_slots(metadata.slot_mapping))
        store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale, kept)
        return self.attend(query, k_cache, v_cache, metadata, scale, k_scale, v_scale, self.flash_prompts)
