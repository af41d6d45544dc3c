"""StepPlan: everything one step needs on the device, as plain arrays. Built on rank 0 from the scheduler's batch;
the executor never sees a Sequence, so a plan can be broadcast to ranks that have none.

Packed layout: the step's new tokens of all sequences are concatenated, sequence after sequence (see
attention/metadata.py). Row r of `sample_rows` is the packed row whose logits sample the step's r-th token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SamplingArrays:
    """Per sampled row. top_ps / top_ks are None when no row uses them, so such a batch pays nothing for them."""

    temperatures: np.ndarray  # [num_sampled] float32; 0 = greedy
    top_ps: np.ndarray | None  # [num_sampled] float32
    top_ks: np.ndarray | None  # [num_sampled] int64; 0 = off
    seeds: list[int | None]  # per row: the request's seed, or None to draw from the engine's generator
    request_ids: list[str]  # per row: whose random state a seeded row advances


@dataclass(slots=True)
class StepPlan:
    step_id: int
    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER (-1) where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: block_id * block_size + offset, -1 = store nothing
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32: context length after this step
    block_tables: np.ndarray  # [num_seqs, width] int32
    sample_rows: np.ndarray  # [num_sampled] int64: packed row of each sampling sequence's last new token
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one new token
    # Rows whose input token was sampled by the step still in flight, and that token's row among its samples.
    placeholder_rows: np.ndarray  # [num_placeholders] int64
    placeholder_sources: np.ndarray  # [num_placeholders] int64
    sampling: SamplingArrays | None  # None on tensor-parallel ranks other than 0, which do not sample
    # Requests that ended since the last plan: the device side drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return len(self.sample_rows)
