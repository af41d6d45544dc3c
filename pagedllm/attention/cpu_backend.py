"""The CPU attention backend: decode and verify rows attend over the paged cache in place, through the block table,
in C++ (cpu_paged_attention.cpp: no copy of any context); prompt chunks attend as in the torch backend, a chunk over
its sequence's gathered context with SDPA.

Invariant, as the torch backend's: a decoding row's output has the same bits whatever else the step holds (the
kernel computes each row alone, the same way for its visible length), so batch composition and speculation leave
greedy output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import PromptChunk, TorchAttentionBackend, attend_chunks, split_rows
from pagedllm.cpu_kernels import require


@dataclass(slots=True)
class DecodingRows:
    """The rows the kernel attends: which rows (None: every row, in order), each row's sequence (its block-table
    row; None: row r is sequence r) and the keys it sees (int32)."""

    rows: torch.Tensor | None
    seqs: torch.Tensor | None
    visible: torch.Tensor


@dataclass(slots=True)
class CpuStepLayout:
    chunks: list[PromptChunk]
    decoding: DecodingRows | None


def cpu_step_layout(metadata: AttentionMetadata, block_size: int) -> CpuStepLayout:
    if metadata.decode_only:
        return CpuStepLayout([], DecodingRows(None, None, metadata.seq_lens.int()))
    split = split_rows(metadata, block_size)
    if not split.short_rows:
        return CpuStepLayout(split.chunks, None)
    int32 = torch.int32
    decoding = DecodingRows(
        torch.tensor(split.short_rows),
        torch.tensor(split.short_seqs, dtype=int32),
        torch.tensor(split.short_visible, dtype=int32),
    )
    return CpuStepLayout(split.chunks, decoding)


def step_layout(metadata: AttentionMetadata, block_size: int) -> CpuStepLayout:
    """The step's layout, computed by the first layer that asks (the decode stack or the first attention layer)."""
    return metadata.once("cpu_backend.layout", lambda: cpu_step_layout(metadata, block_size))


def block_tables(metadata: AttentionMetadata) -> torch.Tensor:
    """The step's block tables as the kernel reads them (int32, contiguous), converted once for every layer."""
    return metadata.once("cpu_backend.tables", lambda: metadata.block_tables.int().contiguous())


def attend_in_place(query, rows: DecodingRows, kv, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    k_cache, v_cache, k_scale, v_scale = kv
    return torch.ops.pagedllm_cpu.paged_attention_rows(
        query.contiguous(), k_cache, v_cache, block_tables, rows.seqs, rows.visible, scale, k_scale, v_scale
    )


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
    """Causal attention of the packed queries over each sequence's cached context (new tokens already stored), as
    torch_backend.paged_attention computes it."""
    layout, tables = step_layout(metadata, k_cache.shape[1]), block_tables(metadata)
    kv, decoding = (k_cache, v_cache, k_scale, v_scale), layout.decoding
    if decoding is not None and decoding.rows is None:
        return attend_in_place(query, decoding, kv, tables, scale)
    out = torch.empty_like(query)
    attend_chunks(query, layout.chunks, kv, scale, flash_prompts, out)
    if decoding is not None:
        out[decoding.rows] = attend_in_place(query[decoding.rows], decoding, kv, tables, scale)
    return out


def stores_in_cpp(key_dtype: torch.dtype, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether new K/V rows are copied into the cache by store_kv_ (a cache of the model's dtype, no fp8 scales);
    else the torch backend's store converts them."""
    return k_scale is None and k_cache.dtype == key_dtype


class CpuAttentionBackend(TorchAttentionBackend):
    """The new K/V stored in C++ (the torch backend's store for an fp8 cache, or a cache of another dtype than the
    model's), then paged_attention above."""

    name = "cpu"
    attend = staticmethod(paged_attention)

    def __init__(self, flash_prompts: bool = False):
        require()  # kernel_selection chose this backend only where the kernels load
        super().__init__(flash_prompts)

    def forward(
        self, query, key, value, k_cache, v_cache, metadata: AttentionMetadata, scale: float, k_scale=None, v_scale=None
    ):
        if not stores_in_cpp(key.dtype, k_cache, k_scale):
            return super().forward(query, key, value, k_cache, v_cache, metadata, scale, k_scale, v_scale)
        torch.ops.pagedllm_cpu.store_kv_(key, value, k_cache, v_cache, metadata.slot_mapping)
        return self.attend(query, k_cache, v_cache, metadata, scale, k_scale, v_scale, self.flash_prompts)
