"""Turn the scheduler's batch into a StepPlan: numpy over whole arrays, Python loops per sequence, never per token.

This is the only place where scheduler objects become device inputs.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from pagedllm.executor.step_plan import SamplingArrays, StepPlan
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence


def sampling_arrays(seqs: list[Sequence]) -> SamplingArrays:
    params: list[SamplingParams] = [seq.sampling_params for seq in seqs]
    return SamplingArrays(
        temperatures=np.array([p.temperature for p in params], dtype=np.float32),
        top_ps=np.array([p.top_p for p in params], dtype=np.float32) if any(p.top_p < 1 for p in params) else None,
        top_ks=np.array([p.top_k for p in params], dtype=np.int64) if any(p.top_k > 0 for p in params) else None,
        seeds=[p.seed if p.temperature > 0 else None for p in params],
        request_ids=[seq.request_id for seq in seqs],
    )


def block_table_array(block_tables: list[list[int]], width: int) -> np.ndarray:
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, blocks in enumerate(block_tables):
        table[row, : len(blocks)] = blocks
    return table


def build_step_plan(
    batch: ScheduledBatch, step_id: int, block_size: int, table_width: int | None, finished_request_ids: list[str]
) -> tuple[StepPlan, list[Sequence]]:
    """Returns the plan and the sequences that own its sample rows, in row order.

    table_width: every block table padded to this many entries (the CUDA graphs' buffer width); None = the widest.
    """
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
    owners = [seqs[i] for i in sampled]
    plan = StepPlan(
        step_id=step_id,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        sample_rows=query_start_loc[1:][sampled] - 1,
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        decode_only=bool((num_new == 1).all()),
        placeholder_rows=query_start_loc[pending],
        placeholder_sources=np.array([seqs[i].pending_sample_index for i in pending], dtype=np.int64),
        sampling=sampling_arrays(owners),
        finished_request_ids=finished_request_ids,
    )
    return plan, owners
