"""Turn a scheduled batch into the step's tensors: input ids, positions, attention metadata, rows to sample.

Built with numpy over whole arrays; the only Python loops are per sequence, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.scheduler.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64: the last new token of each sequence that samples this step
    sampled_seq_indices: list[int]  # which batch entries those rows belong to


def block_table_array(block_tables: list[list[int]], width: int) -> np.ndarray:
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, blocks in enumerate(block_tables):
        table[row, : len(blocks)] = blocks
    return table


def build_step_inputs(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    seqs = batch.seqs
    num_new = np.array(batch.num_new_tokens, dtype=np.int64)
    start = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
    seq_lens = start + num_new
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_seq = np.repeat(np.arange(len(seqs)), num_new)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - start, num_new)
    input_ids = list(chain.from_iterable(seq.token_ids[s:e] for seq, s, e in zip(seqs, start, seq_lens)))
    block_tables = block_table_array([seq.block_table for seq in seqs], max(len(seq.block_table) for seq in seqs))
    slot_mapping = (
        block_tables[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )

    sampled = [i for i, seq in enumerate(seqs) if seq_lens[i] == seq.num_tokens]
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        query_start_loc=to_device(query_start_loc.astype(np.int32), device),
        seq_lens=to_device(seq_lens.astype(np.int32), device),
        block_tables=to_device(block_tables, device),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        decode_only=bool((num_new == 1).all()),
    )
    return StepInputs(
        input_ids=to_device(np.array(input_ids, dtype=np.int64), device),
        positions=to_device(positions, device),
        metadata=metadata,
        sample_rows=to_device(query_start_loc[1:][sampled] - 1, device),
        sampled_seq_indices=sampled,
    )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
