"""A StepPlan's arrays as device tensors: on CPU by wrapping the numpy arrays, on CUDA through pinned staging into
preallocated device buffers that the CUDA graphs read from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.executor.step_plan import StepPlan


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor
    placeholder_rows: torch.Tensor
    placeholder_sources: torch.Tensor


def pad_decode_plan(plan: StepPlan, num_seqs: int) -> None:
    """Append padding sequences of one token, seq_len 0 and slot -1: attention stores and reads nothing for them."""
    assert plan.decode_only, "only decode steps (one token per sequence) are padded"
    extra = num_seqs - plan.num_seqs
    if extra <= 0:
        return
    plan.input_ids = np.concatenate([plan.input_ids, np.zeros(extra, np.int64)])
    plan.positions = np.concatenate([plan.positions, np.zeros(extra, np.int64)])
    plan.slot_mapping = np.concatenate([plan.slot_mapping, np.full(extra, -1, np.int64)])
    plan.query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    plan.seq_lens = np.concatenate([plan.seq_lens, np.zeros(extra, np.int32)])
    padding_tables = np.zeros((extra, plan.block_tables.shape[1]), np.int32)
    plan.block_tables = np.concatenate([plan.block_tables, padding_tables])


@dataclass(slots=True)
class PinnedBuffer:
    """A device tensor with a pinned host twin: a slice of the twin is filled from numpy, then copied asynchronously."""

    device: torch.Tensor
    host: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> PinnedBuffer:
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, pin_memory=True))

    def upload(self, array: np.ndarray) -> torch.Tensor:
        host = self.host[: len(array)]
        host.numpy()[...] = array
        device = self.device[: len(array)]
        device.copy_(host, non_blocking=True)
        return device


@dataclass(slots=True)
class StepBuffers:
    """Device tensors big enough for any step. The same device memory serves every step, so a CUDA graph
    captured on slices of it sees each step's data."""

    input_ids: PinnedBuffer  # [max_tokens] int64
    positions: PinnedBuffer  # [max_tokens] int64
    slot_mapping: PinnedBuffer  # [max_tokens] int64
    query_start_loc: PinnedBuffer  # [max_seqs + 1] int32
    seq_lens: PinnedBuffer  # [max_seqs] int32
    block_tables: PinnedBuffer  # [max_seqs, table_width] int32
    sample_rows: PinnedBuffer  # [max_seqs] int64
    placeholder_rows: PinnedBuffer  # [max_seqs] int64
    placeholder_sources: PinnedBuffer  # [max_seqs] int64
    # The host twins are rewritten each step: wait until the previous step's copies have left them.
    uploads_done: torch.cuda.Event

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, table_width: int, device: torch.device) -> StepBuffers:
        def buffer(shape, dtype):
            return PinnedBuffer.zeros(shape, dtype, device)

        buffers = cls(
            input_ids=buffer((max_tokens,), torch.int64),
            positions=buffer((max_tokens,), torch.int64),
            slot_mapping=buffer((max_tokens,), torch.int64),
            query_start_loc=buffer((max_seqs + 1,), torch.int32),
            seq_lens=buffer((max_seqs,), torch.int32),
            block_tables=buffer((max_seqs, table_width), torch.int32),
            sample_rows=buffer((max_seqs,), torch.int64),
            placeholder_rows=buffer((max_seqs,), torch.int64),
            placeholder_sources=buffer((max_seqs,), torch.int64),
            uploads_done=torch.cuda.Event(),
        )
        buffers.slot_mapping.device.fill_(-1)
        return buffers

    def upload(self, plan: StepPlan) -> StepInputs:
        """Every copy goes from pinned memory, so none of them waits for the device to finish earlier steps."""
        self.uploads_done.synchronize()
        inputs = StepInputs(
            input_ids=self.input_ids.upload(plan.input_ids),
            positions=self.positions.upload(plan.positions),
            metadata=AttentionMetadata(
                slot_mapping=self.slot_mapping.upload(plan.slot_mapping),
                query_start_loc=self.query_start_loc.upload(plan.query_start_loc),
                seq_lens=self.seq_lens.upload(plan.seq_lens),
                block_tables=self.block_tables.upload(plan.block_tables),
                max_query_len=plan.max_query_len,
                max_seq_len=plan.max_seq_len,
                decode_only=plan.decode_only,
            ),
            sample_rows=self.sample_rows.upload(plan.sample_rows),
            placeholder_rows=self.placeholder_rows.upload(plan.placeholder_rows),
            placeholder_sources=self.placeholder_sources.upload(plan.placeholder_sources),
        )
        self.uploads_done.record()
        return inputs


def wrap_plan(plan: StepPlan) -> StepInputs:
    """CPU: the tensors share memory with the plan's numpy arrays."""
    return StepInputs(
        input_ids=torch.from_numpy(plan.input_ids),
        positions=torch.from_numpy(plan.positions),
        metadata=AttentionMetadata(
            slot_mapping=torch.from_numpy(plan.slot_mapping),
            query_start_loc=torch.from_numpy(plan.query_start_loc),
            seq_lens=torch.from_numpy(plan.seq_lens),
            block_tables=torch.from_numpy(plan.block_tables),
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            decode_only=plan.decode_only,
        ),
        sample_rows=torch.from_numpy(plan.sample_rows),
        placeholder_rows=torch.from_numpy(plan.placeholder_rows),
        placeholder_sources=torch.from_numpy(plan.placeholder_sources),
    )
