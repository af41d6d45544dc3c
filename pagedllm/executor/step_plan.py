"""StepPlan: everything one step needs on the device, as plain arrays. Built on rank 0 from the scheduler's batch;
the executor never sees a Sequence, so a plan can be broadcast to ranks that have none.

Packed layout: the step's new tokens of all sequences are concatenated, sequence after sequence (see
attention/metadata.py). Row r of `sample_rows` is the packed row whose logits sample the step's r-th token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.layers.sampling_batch import SamplingBatch
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerRequest:
    """A sequence that took a slot: the sampler sets up its state there (penalty counts, seeded generator)."""

    slot: int
    request_id: str
    params: SamplingParams  # one sample's: n = 1, and its own seed
    prompt_token_ids: list[int]  # for repetition_penalty, which counts prompt tokens too


@dataclass(slots=True)
class StepSampling:
    """The part of a plan only the sampling rank needs (rank 0; None on the other tensor-parallel ranks)."""

    batch: SamplingBatch  # per sample row: temperatures, truncation, seeds, penalties, logprobs
    row_slots: np.ndarray  # [num_sampled] int64: each sample row's slot
    # Applied before this step samples, releases first (a slot released and taken again in one plan is reset).
    released_slots: list[int] = field(default_factory=list)
    new_requests: list[SamplerRequest] = field(default_factory=list)
    # The prompt token each prompt_logprob_rows row predicts, and the largest top-N asked for among those rows.
    prompt_logprob_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_prompt_logprobs: int = 0


@dataclass(slots=True)
class StepPlan:
    step_id: int
    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER (-1) where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: block_id * block_size + offset, -1 = store nothing
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32: context length after this step
    block_tables: np.ndarray  # [num_seqs, width] int32
    # [num_sampled] int64: packed row of each sampling sequence's last new token. A request's first sample row
    # may repeat for its other samples (n > 1), which take their first tokens from the same logits.
    sample_rows: np.ndarray
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one new token
    # Rows whose input token was sampled by the step still in flight, and that token's row among its samples.
    placeholder_rows: np.ndarray  # [num_placeholders] int64
    placeholder_sources: np.ndarray  # [num_placeholders] int64
    sampling: StepSampling | None  # None on tensor-parallel ranks other than 0, which do not sample
    # Packed rows whose logits give prompt logprobs (the position predicting the next prompt token).
    prompt_logprob_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [num_copies, 2] int64 (source, destination) KV blocks to copy before the step: copy-on-write of shared blocks.
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return len(self.sample_rows)
