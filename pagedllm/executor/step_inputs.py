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


def append_padding_tokens(plan: StepPlan, count: int) -> None:
    """Token 0 at position 0 with slot -1: attention stores nothing for it."""
    plan.input_ids = np.concatenate([plan.input_ids, np.zeros(count, np.int64)])
    plan.positions = np.concatenate([plan.positions, np.zeros(count, np.int64)])
    plan.slot_mapping = np.concatenate([plan.slot_mapping, np.full(count, -1, np.int64)])


def pad_decode_plan(plan: StepPlan, num_seqs: int) -> None:
    """Append padding sequences of one token, seq_len 0 and slot -1: attention stores and reads nothing for them."""
    assert plan.decode_only, "only decode steps (one token per sequence) are padded"
    extra = num_seqs - plan.num_seqs
    if extra <= 0:
        return
    append_padding_tokens(plan, extra)
    plan.query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    plan.seq_lens = np.concatenate([plan.seq_lens, np.zeros(extra, np.int32)])
    padding_tables = np.zeros((extra, plan.block_tables.shape[1]), np.int32)
    plan.block_tables = np.concatenate([plan.block_tables, padding_tables])


def pad_prefill_plan(plan: StepPlan, num_tokens: int, num_seqs: int) -> None:
    """Append padding tokens that belong to no sequence (slot -1: nothing stored) and empty padding sequences
    (query_start_loc repeats its last value, seq_len 0), so that the step has the shapes of a prefill graph.
    The padding sequences' block-table rows are not written: an empty sequence's row is never read."""
    assert not plan.decode_only, "decode steps are padded by pad_decode_plan"
    extra_tokens, extra_seqs = num_tokens - plan.num_tokens, num_seqs - plan.num_seqs
    assert extra_tokens >= 0 and extra_seqs >= 0, "a plan is padded only to a larger step"
    if extra_tokens:
        append_padding_tokens(plan, extra_tokens)
    if extra_seqs:
        last = plan.query_start_loc[-1]
        plan.query_start_loc = np.concatenate([plan.query_start_loc, np.full(extra_seqs, last, np.int32)])
        plan.seq_lens = np.concatenate([plan.seq_lens, np.zeros(extra_seqs, np.int32)])


# The plan's arrays that go to the device, in their order inside a pack: rows per sequence first, the block tables
# (by far the largest, num_seqs x table_width) last, so one copy up to the last used table row carries them all.
# (name, dtype, rows: "tokens" or "seqs", extra rows)
PACKED_FIELDS = (
    ("input_ids", np.int64, "tokens", 0),
    ("positions", np.int64, "tokens", 0),
    ("slot_mapping", np.int64, "tokens", 0),
    ("sample_rows", np.int64, "seqs", 0),
    ("placeholder_rows", np.int64, "seqs", 0),
    ("placeholder_sources", np.int64, "seqs", 0),
    ("query_start_loc", np.int32, "seqs", 1),
    ("seq_lens", np.int32, "seqs", 0),
    # Rows of table_width entries. A plan's tables may be narrower (as wide as its longest): the columns past them
    # keep earlier steps' block ids. Kernels read a row only up to its seq_len, and the torch backend masks what it
    # gathers past it; every value ever written is a valid block id.
    ("block_tables", np.int32, "seqs", 0),
)
ALIGNMENT = 64  # bytes: each field's offset in a pack


class PackedInputs:
    """Every array of a step at a fixed offset in one host buffer (pinned on CUDA) and in its device twin of the
    same layout. A step writes its arrays into the host buffer, then one asynchronous copy moves the bytes up to the
    end of the last one (nine separate copies cost the host ~0.2 ms per step on the H200). A field's device view
    never moves, so a CUDA graph captured on it reads each later step's values."""

    def __init__(self, max_tokens: int, max_seqs: int, table_width: int, device: torch.device):
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.layout: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes)
        offset = 0
        for name, dtype, rows, extra in PACKED_FIELDS:
            count = (max_tokens if rows == "tokens" else max_seqs) + extra
            count *= table_width if name == "block_tables" else 1
            self.layout[name] = (offset, count * np.dtype(dtype).itemsize)
            offset += -(-count * np.dtype(dtype).itemsize // ALIGNMENT) * ALIGNMENT
        self.host_bytes = torch.zeros(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_bytes = torch.zeros(offset, dtype=torch.uint8, device=device)
        host = self.host_bytes.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, dtype, _, _ in PACKED_FIELDS:
            start, size = self.layout[name]
            self.host[name] = host[start : start + size].view(dtype)
            self.device[name] = self.device_bytes[start : start + size].view(torch.from_numpy(self.host[name]).dtype)
        self.host["block_tables"] = self.host["block_tables"].reshape(max_seqs, table_width)
        self.device["block_tables"] = self.device["block_tables"].view(max_seqs, table_width)

    def holds(self, plan: StepPlan) -> bool:
        return plan.num_tokens <= self.max_tokens and plan.num_seqs <= self.max_seqs

    def upload(self, plan: StepPlan) -> StepInputs:
        """Write the plan into the host buffer and queue the copy (the caller makes sure the previous copy has left
        the host buffer)."""
        end = 0
        for name, _, _, _ in PACKED_FIELDS:
            array = getattr(plan, name)
            host = self.host[name]
            if array.ndim == 2:  # block tables: a plan's may be narrower than the buffer's rows
                host[: len(array), : array.shape[1]] = array
            else:
                host[: len(array)] = array
            if len(array):
                end = max(end, self.layout[name][0] + host[: len(array)].nbytes)
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
        device = self.device
        return StepInputs(
            input_ids=device["input_ids"][: plan.num_tokens],
            positions=device["positions"][: plan.num_tokens],
            metadata=AttentionMetadata(
                slot_mapping=device["slot_mapping"][: plan.num_tokens],
                query_start_loc=device["query_start_loc"][: plan.num_seqs + 1],
                seq_lens=device["seq_lens"][: plan.num_seqs],
                block_tables=device["block_tables"][: plan.num_seqs],
                max_query_len=plan.max_query_len,
                max_seq_len=plan.max_seq_len,
                decode_only=plan.decode_only,
            ),
            sample_rows=device["sample_rows"][: plan.num_sampled],
            placeholder_rows=device["placeholder_rows"][: len(plan.placeholder_rows)],
            placeholder_sources=device["placeholder_sources"][: len(plan.placeholder_sources)],
        )


class StepBuffers:
    """Two packs: one as large as a decode step can be (max_seqs tokens), which the CUDA graphs read, so a decode
    step copies little more than its block tables; one as large as any step (max_tokens), for the others."""

    def __init__(self, max_tokens: int, max_seqs: int, table_width: int, device: torch.device):
        self.decode = PackedInputs(max_seqs, max_seqs, table_width, device)
        self.decode.device["slot_mapping"].fill_(-1)
        self.any_step = PackedInputs(max_tokens, max_seqs, table_width, device)
        # The host buffers are rewritten each step: wait until the previous step's copy has left them.
        self.uploads_done = torch.cuda.Event() if device.type == "cuda" else None

    def upload(self, plan: StepPlan) -> StepInputs:
        """The copy goes from pinned memory, so it does not wait for the device to finish earlier steps."""
        if self.uploads_done is not None:
            self.uploads_done.synchronize()
        pack = self.decode if plan.decode_only and self.decode.holds(plan) else self.any_step
        inputs = pack.upload(plan)
        if self.uploads_done is not None:
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
