"""Turn a scheduled batch into the step's inputs: input ids, positions, attention metadata, rows to sample.

Built on the host with numpy over whole arrays (the only Python loops are per sequence, never per token), then
uploaded: on CPU by wrapping the arrays, on CUDA through pinned staging into preallocated device buffers that
the CUDA graphs read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.scheduler.scheduler import ScheduledBatch


@dataclass(slots=True)
class HostStepInputs:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64, -1 on padding rows
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32, 0 on padding rows
    block_tables: np.ndarray  # [num_seqs, table_width] int32
    sample_rows: np.ndarray  # [num_sampled] int64: each sampling sequence's last new token
    sampled_seq_indices: list[int]  # which batch entries sample this step
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    # Rows whose input token is a PLACEHOLDER, and where in the in-flight step's samples the real token is.
    placeholder_rows: np.ndarray
    placeholder_sources: np.ndarray


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor
    sampled_seq_indices: list[int]
    placeholder_rows: torch.Tensor
    placeholder_sources: torch.Tensor
    sampling: dict[str, torch.Tensor]  # per sampled row: temperatures, and top_ps / top_ks where used


def block_table_array(block_tables: list[list[int]], width: int) -> np.ndarray:
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, blocks in enumerate(block_tables):
        table[row, : len(blocks)] = blocks
    return table


def build_host_inputs(
    batch: ScheduledBatch, block_size: int, table_width: int | None = None, pad_to: int | None = None
) -> HostStepInputs:
    """pad_to (decode steps only) appends padding sequences of one token, seq_len 0 and slot -1."""
    seqs = batch.seqs
    num_new = np.array(batch.num_new_tokens, dtype=np.int64)
    start = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
    seq_lens = start + num_new
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_seq = np.repeat(np.arange(len(seqs)), num_new)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - start, num_new)
    input_ids = np.fromiter(
        chain.from_iterable(seq.token_ids[s:e] for seq, s, e in zip(seqs, start, seq_lens)), np.int64, num_tokens
    )
    width = table_width or max(len(seq.block_table) for seq in seqs)
    block_tables = block_table_array([seq.block_table for seq in seqs], width)
    slot_mapping = block_tables[token_seq, positions // block_size] * np.int64(block_size) + positions % block_size
    sampled = [i for i, seq in enumerate(seqs) if seq_lens[i] == seq.num_tokens]
    # A pending token is its sequence's only uncomputed token, so it is that sequence's first (only) new row.
    pending = [i for i, seq in enumerate(seqs) if seq.pending_sample_index >= 0]
    inputs = HostStepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        sample_rows=query_start_loc[1:][sampled] - 1,
        sampled_seq_indices=sampled,
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        decode_only=bool((num_new == 1).all()),
        placeholder_rows=query_start_loc[pending],
        placeholder_sources=np.array([seqs[i].pending_sample_index for i in pending], dtype=np.int64),
    )
    if pad_to is not None and pad_to > len(seqs):
        pad_decode_inputs(inputs, pad_to)
    return inputs


def pad_decode_inputs(inputs: HostStepInputs, num_seqs: int) -> None:
    assert inputs.decode_only, "only decode steps (one token per sequence) are padded"
    extra = num_seqs - len(inputs.seq_lens)
    inputs.input_ids = np.concatenate([inputs.input_ids, np.zeros(extra, np.int64)])
    inputs.positions = np.concatenate([inputs.positions, np.zeros(extra, np.int64)])
    inputs.slot_mapping = np.concatenate([inputs.slot_mapping, np.full(extra, -1, np.int64)])
    inputs.query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    inputs.seq_lens = np.concatenate([inputs.seq_lens, np.zeros(extra, np.int32)])
    padding_tables = np.zeros((extra, inputs.block_tables.shape[1]), np.int32)
    inputs.block_tables = np.concatenate([inputs.block_tables, padding_tables])


class StepBuffers:
    """Device tensors big enough for any step, each with a pinned host twin for asynchronous uploads.

    The same device memory serves every step, so a CUDA graph captured on slices of it sees each step's data.
    """

    def __init__(self, max_tokens: int, max_seqs: int, table_width: int, device: torch.device):
        self.device = device
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            "block_tables": ((max_seqs, table_width), torch.int32),
            "sample_rows": ((max_seqs,), torch.int64),
            "placeholder_rows": ((max_seqs,), torch.int64),
            "placeholder_sources": ((max_seqs,), torch.int64),
            "temperatures": ((max_seqs,), torch.float32),
            "top_ps": ((max_seqs,), torch.float32),
            "top_ks": ((max_seqs,), torch.int64),
        }
        self.device_tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()
        }
        self.host_tensors = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=True) for name, (shape, dtype) in shapes.items()
        }
        self.device_tensors["slot_mapping"].fill_(-1)
        # The host twins are rewritten each step: wait until the previous step's copies have left them.
        self.uploads_done = torch.cuda.Event()

    def upload_array(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = self.host_tensors[name][: len(array)]
        host.numpy()[...] = array
        device = self.device_tensors[name][: len(array)]
        device.copy_(host, non_blocking=True)
        return device

    def upload(self, inputs: HostStepInputs, sampling: dict[str, np.ndarray]) -> StepInputs:
        """Every copy goes from pinned memory, so none of them waits for the device to finish earlier steps."""
        self.uploads_done.synchronize()
        metadata = AttentionMetadata(
            slot_mapping=self.upload_array("slot_mapping", inputs.slot_mapping),
            query_start_loc=self.upload_array("query_start_loc", inputs.query_start_loc),
            seq_lens=self.upload_array("seq_lens", inputs.seq_lens),
            block_tables=self.upload_array("block_tables", inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            decode_only=inputs.decode_only,
        )
        step_inputs = StepInputs(
            input_ids=self.upload_array("input_ids", inputs.input_ids),
            positions=self.upload_array("positions", inputs.positions),
            metadata=metadata,
            sample_rows=self.upload_array("sample_rows", inputs.sample_rows),
            sampled_seq_indices=inputs.sampled_seq_indices,
            placeholder_rows=self.upload_array("placeholder_rows", inputs.placeholder_rows),
            placeholder_sources=self.upload_array("placeholder_sources", inputs.placeholder_sources),
            sampling={name: self.upload_array(name, array) for name, array in sampling.items()},
        )
        self.uploads_done.record()
        return step_inputs


def wrap_host_inputs(inputs: HostStepInputs, sampling: dict[str, np.ndarray]) -> StepInputs:
    """CPU: the tensors share memory with the numpy arrays."""
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(inputs.slot_mapping),
        query_start_loc=torch.from_numpy(inputs.query_start_loc),
        seq_lens=torch.from_numpy(inputs.seq_lens),
        block_tables=torch.from_numpy(inputs.block_tables),
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
        decode_only=inputs.decode_only,
    )
    return StepInputs(
        input_ids=torch.from_numpy(inputs.input_ids),
        positions=torch.from_numpy(inputs.positions),
        metadata=metadata,
        sample_rows=torch.from_numpy(inputs.sample_rows),
        sampled_seq_indices=inputs.sampled_seq_indices,
        placeholder_rows=torch.from_numpy(inputs.placeholder_rows),
        placeholder_sources=torch.from_numpy(inputs.placeholder_sources),
        sampling={name: torch.from_numpy(array) for name, array in sampling.items()},
    )
