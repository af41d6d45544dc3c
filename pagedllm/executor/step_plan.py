"""StepPlan: everything one step needs on the device, as plain arrays. Built on rank 0 from the scheduler's batch;
the executor never sees a Sequence, so a plan can be broadcast to ranks that have none.

Packed layout: the step's new tokens of all sequences are concatenated, sequence after sequence (see
attention/metadata.py). Row r of `sample_rows` is the packed row whose logits sample the step's r-th token.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from pagedllm.executor.plan_fields import (
    BLOCK_COPIES,
    MASKED,
    PLACEHOLDERS,
    PROMPT_LOGPROB_ROWS,
    QUERY_STARTS,
    SAMPLED,
    SEQS,
    TABLE_ROWS,
    TOKENS,
    plan_array,
    plan_scalar,
)
from pagedllm.sampling.batch import SamplingBatch
from pagedllm.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplerRequest:
    """A sequence that took a state index: the sampler sets up its state at that index (penalty counts,
    seeded generator)."""

    state_index: int
    request_id: str
    params: SamplingParams  # one sample's: n = 1, and its own seed
    prompt_token_ids: list[int]  # for repetition_penalty, which counts prompt tokens too


@dataclass(slots=True)
class StepSampling:
    """The part of a plan only the sampling rank needs (rank 0; None on the other tensor-parallel ranks)."""

    batch: SamplingBatch  # per sample row: temperatures, truncation, seeds, penalties, logprobs
    row_state_indices: np.ndarray  # [num_sampled] int64: each sample row's state index
    # Applied before this step samples, releases first (an index released and taken again in one plan is reset).
    released_state_indices: list[int] = field(default_factory=list)
    new_requests: list[SamplerRequest] = field(default_factory=list)
    # The prompt token each prompt_logprob_rows row predicts, and the largest top-N asked for among those rows.
    prompt_logprob_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_prompt_logprobs: int = 0
    # Speculative decoding: what the previous step's rejected verify rows must not leave behind, applied after the
    # registrations: (state index, row of the previous step) generators put back to their state after that row's
    # draw, and (state index, token id) penalty counts taken back.
    generator_rewinds: list[tuple[int, int]] = field(default_factory=list)
    uncounted_tokens: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """Each field declared once (plan_fields.py): a new capability adds its arrays here, or in a subclass, and
    everything between its producer and its consumer follows. Padding returns a new plan (step_inputs.py)."""

    step_id: int = plan_scalar(int)
    max_query_len: int = plan_scalar(int)
    max_seq_len: int = plan_scalar(int)
    decode_only: bool = plan_scalar(bool)  # every sequence has exactly one new token
    # PLACEHOLDER (-1) where the token is still on the device
    input_ids: np.ndarray = plan_array(np.int64, TOKENS)
    positions: np.ndarray = plan_array(np.int64, TOKENS)
    # block_id * block_size + offset, -1 = store nothing
    slot_mapping: np.ndarray = plan_array(np.int64, TOKENS, pad=-1)
    query_start_loc: np.ndarray = plan_array(np.int32, QUERY_STARTS)
    seq_lens: np.ndarray = plan_array(np.int32, SEQS)  # context length after this step; 0 for padding sequences
    # Each sequence: 1 when its new tokens are past its prompt (decode or verify rows), 0 in a prompt chunk. The torch
    # attention backend attends a decoding sequence's rows one at a time (attention/torch_backend.py's invariant).
    decoding: np.ndarray = plan_array(np.int32, SEQS, upload=False)
    # As wide as the plan's longest, which may be narrower than the buffers' rows: the columns past it keep earlier
    # steps' block ids. Kernels read a row only up to its seq_len, and the torch backend masks what it gathers past
    # it; every value ever written is a valid block id.
    block_tables: np.ndarray = plan_array(np.int32, TABLE_ROWS, columns="table_width")
    # Packed row of each sampling sequence's last new token. A request's first sample row may repeat for its other
    # samples (n > 1), which take their first tokens from the same logits.
    sample_rows: np.ndarray = plan_array(np.int64, SAMPLED)
    # Rows whose input token was sampled by the step still in flight, and that token's row among its samples.
    placeholder_rows: np.ndarray = plan_array(np.int64, PLACEHOLDERS)
    placeholder_sources: np.ndarray = plan_array(np.int64, PLACEHOLDERS)
    # Packed rows whose logits give prompt logprobs (the position predicting the next prompt token).
    prompt_logprob_rows: np.ndarray = plan_array(np.int64, PROMPT_LOGPROB_ROWS, upload=False)
    # (source, destination) KV blocks to copy before the step: copy-on-write of shared blocks.
    block_copies: np.ndarray = plan_array(np.int64, BLOCK_COPIES, columns=2, upload=False)
    # Structured outputs, rank 0's alone: the sample rows a grammar constrains, ascending. Their masks are no plan
    # field: the matchers fill them while the device runs the forward (Executor.execute's `masks`). A step without a
    # constrained row has none here, and no mask is filled, uploaded or applied.
    bitmask_rows: np.ndarray = plan_array(np.int64, MASKED, broadcast=False)
    sampling: StepSampling | None = None  # rank 0's alone: None on the other tensor-parallel ranks, which do not sample

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return len(self.sample_rows)


def block_table_array(block_tables: list[array], width: int) -> np.ndarray:
    """The int32 block tables (Sequence.block_table) as rows of one [len(block_tables), width] array, zero-padded:
    their bytes are joined once and scattered under a mask (a row at a time costs ~4x more at 256 sequences)."""
    lengths = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    table[np.arange(width) < lengths[:, None]] = np.frombuffer(b"".join(block_tables), dtype=np.int32)
    return table
