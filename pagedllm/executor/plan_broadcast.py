"""Rank 0 hands each step's plan to the other tensor-parallel ranks with two torch.distributed broadcasts on a CPU
(gloo) group: a fixed-size header of lengths and flags, then every array of the plan end to end in one int32 tensor
(every value fits: token ids, positions, slots and block ids are all far below 2^31; half the bytes of int64, and
the block tables, most of a decode plan, need no conversion on arrival).
Nothing is pickled. The other ranks get no sampling arrays: only rank 0 samples.

Rank 0 does not wait for the broadcasts: gloo's own thread sends them while rank 0 runs its shard of the same step
(a gloo broadcast returns only once every rank has posted its receive, which would tie rank 0's host to the other
ranks' host loops). The receivers take each plan in order; broadcasts are matched by their sequence in the group.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.executor.step_plan import StepPlan

RUN_STEP, SHUT_DOWN = 1, 2
# header: command, step_id, num_tokens, num_seqs, table_width, num_sampled, num_placeholders,
# num_prompt_logprob_rows, num_block_copies, max_query_len, max_seq_len, decode_only
HEADER_SIZE = 12


def pack_plan(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a plan: an int64 header HEADER_SIZE long and an int32 payload."""
    num_seqs, table_width = plan.block_tables.shape
    header = [RUN_STEP, plan.step_id, plan.num_tokens, num_seqs, table_width, plan.num_sampled,
              len(plan.placeholder_rows), len(plan.prompt_logprob_rows), len(plan.block_copies), plan.max_query_len,
              plan.max_seq_len, int(plan.decode_only)]  # fmt: skip
    arrays = (plan.input_ids, plan.positions, plan.slot_mapping, plan.query_start_loc, plan.seq_lens,
              plan.block_tables.ravel(), plan.sample_rows, plan.placeholder_rows, plan.placeholder_sources,
              plan.prompt_logprob_rows, plan.block_copies.ravel())  # fmt: skip
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(np.concatenate(arrays, dtype=np.int32))


def array_lengths(header: list[int]) -> list[int]:
    """How long each of the payload's arrays is, in the order pack_plan concatenates them."""
    _, _, num_tokens, num_seqs, width, num_sampled, num_placeholders, num_prompt_rows, num_copies = header[:9]
    tokens, seqs = [num_tokens] * 3, [num_seqs + 1, num_seqs, num_seqs * width]
    return tokens + seqs + [num_sampled, num_placeholders, num_placeholders, num_prompt_rows, 2 * num_copies]


def unpack_plan(header: list[int], payload: np.ndarray) -> StepPlan:
    """The plan pack_plan packed, without its sampling arrays."""
    _, step_id, _, num_seqs, width, _, _, _, _, max_query_len, max_seq_len, decode_only = header
    arrays = np.split(payload, np.cumsum(array_lengths(header))[:-1])
    input_ids, positions, slots, query_start, seq_lens, tables, sample_rows, rows, sources, prompt_rows, copies = arrays
    return StepPlan(
        step_id=step_id,
        input_ids=input_ids.astype(np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=slots.astype(np.int64),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables.reshape(num_seqs, width),
        sample_rows=sample_rows.astype(np.int64),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        decode_only=bool(decode_only),
        placeholder_rows=rows.astype(np.int64),
        placeholder_sources=sources.astype(np.int64),
        sampling=None,
        prompt_logprob_rows=prompt_rows.astype(np.int64),
        block_copies=copies.astype(np.int64).reshape(-1, 2),
    )


class PlanSender:
    """Rank 0's side. Invariant: at most one plan's broadcasts are in flight, and their tensors stay referenced
    here until they complete (gloo reads them from its thread)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, plan: StepPlan) -> None:
        """Queue the plan's broadcasts and return at once (after the previous plan's have completed)."""
        self.wait()
        self.in_flight = [(dist.broadcast(tensor, src=0, group=self.group, async_op=True), tensor)
                          for tensor in pack_plan(plan)]  # fmt: skip

    def wait(self) -> None:
        """Until the plan in flight has reached every rank; raises if a rank is gone."""
        in_flight, self.in_flight = self.in_flight, []
        for work, _ in in_flight:
            work.wait()

    def send_shutdown(self) -> None:
        self.wait()
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[0] = SHUT_DOWN
        dist.broadcast(header, src=0, group=self.group)


def receive_plan(group: dist.ProcessGroup) -> StepPlan | None:
    """The next plan from rank 0 (waiting as long as it takes); None when rank 0 shuts the group down."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    fields = header.tolist()
    if fields[0] == SHUT_DOWN:
        return None
    assert fields[0] == RUN_STEP, f"unknown plan command {fields[0]}"
    payload = torch.empty(sum(array_lengths(fields)), dtype=torch.int32)
    dist.broadcast(payload, src=0, group=group)
    return unpack_plan(fields, payload.numpy())
