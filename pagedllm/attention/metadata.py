"""Step metadata that every attention backend reads: where new K/V go and which cached K/V each query sees.

Packed layout: the step's new tokens of all sequences are concatenated, sequence after sequence.
For sequence i, the new tokens are rows query_start_loc[i] : query_start_loc[i+1] and occupy positions
seq_lens[i] - query_len_i ... seq_lens[i] - 1 of that sequence (earlier positions are already in the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) for each new token's K/V; -1 = don't store.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: cu_seqlens of the queries in the packed batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: tokens in each sequence's context after this step (cached + new). 0 for padding rows.
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: KV block ids in position order; entries past a sequence's end are unused.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # True when every sequence has exactly one new token (the decode fast path that CUDA graphs capture).
    decode_only: bool
    # [num_seqs] on the host, or None: 1 where the sequence's new tokens are past its prompt (decode or verify rows),
    # which the torch backend attends row by row; None: every sequence as a prompt chunk unless decode_only.
    decoding: np.ndarray | None = None
    # What layers derive from this step's inputs alone (the torch backend's gather indices and masks, the rotation's
    # rows): computed by the first layer that asks (once) and shared by the others, since every layer of a step sees
    # the same metadata. A new step builds new metadata, so nothing carries over.
    derived: dict = field(default_factory=dict)

    def once(self, key: str, compute: Callable[[], object]):
        """derived[key], computed on the first call of the step."""
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
