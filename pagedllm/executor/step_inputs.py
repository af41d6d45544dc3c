"""A StepPlan's arrays as device tensors: on CPU by wrapping the numpy arrays, on CUDA through pinned staging into
preallocated device buffers that the CUDA graphs read from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.executor.plan_fields import plan_arrays
from pagedllm.executor.step_plan import StepPlan


@dataclass(slots=True)
class StepInputs:
    """The plan's uploaded arrays as tensors, each cut to the plan's rows (inputs.input_ids, ...), and what attention
    reads."""

    arrays: dict[str, torch.Tensor]
    metadata: AttentionMetadata

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return object.__getattribute__(self, "arrays")[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no array {name!r}") from None


def attention_metadata(arrays: dict[str, torch.Tensor], tables: torch.Tensor, plan: StepPlan) -> AttentionMetadata:
    """From the plan's arrays as tensors (cut to its rows) and its block tables, a row for each sequence."""
    return AttentionMetadata(
        slot_mapping=arrays["slot_mapping"],
        query_start_loc=arrays["query_start_loc"],
        seq_lens=arrays["seq_lens"],
        block_tables=tables,
        max_query_len=plan.max_query_len,
        max_seq_len=plan.max_seq_len,
        decode_only=plan.decode_only,
        decoding=plan.decoding if len(plan.decoding) else None,
    )


def padded_plan(plan: StepPlan, counts: dict[str, int], tokens_per_padding_seq: int) -> StepPlan:
    """A new plan whose arrays of the kinds counted in `counts` have that many rows (plus their kind's extra rows),
    the new rows holding each array's pad value; query starts continue by tokens_per_padding_seq for each padding
    sequence. The arrays not extended are shared with `plan`, which is left as it was; so is an array with no rows
    (its producer did not set it)."""
    changes = {}
    for name, spec in plan_arrays(type(plan)):
        array = getattr(plan, name)
        if spec.rows.count not in counts or not len(array):
            continue
        extra = counts[spec.rows.count] + spec.rows.extra - len(array)
        if extra <= 0:
            continue
        padded = np.empty((len(array) + extra, *array.shape[1:]), dtype=array.dtype)
        padded[: len(array)] = array
        if spec.rows.token_offsets:
            padded[len(array) :] = array[-1] + tokens_per_padding_seq * np.arange(1, extra + 1)
        else:
            padded[len(array) :] = spec.pad
        changes[name] = padded
    return dataclasses.replace(plan, **changes) if changes else plan


def pad_decode_plan(plan: StepPlan, num_seqs: int) -> StepPlan:
    """Padding sequences of one token, seq_len 0 and slot -1: attention stores and reads nothing for them."""
    assert plan.decode_only, "only decode steps (one token per sequence) are padded"
    return padded_plan(plan, {"num_tokens": num_seqs, "num_seqs": num_seqs, "num_table_rows": num_seqs}, 1)


def pad_prefill_plan(plan: StepPlan, num_tokens: int, num_seqs: int) -> StepPlan:
    """Padding tokens that belong to no sequence (slot -1: nothing stored) and empty padding sequences
    (query_start_loc repeats its last value, seq_len 0), so that the step has the shapes of a prefill graph.
    The padding sequences' block-table rows are not written: an empty sequence's row is never read."""
    assert not plan.decode_only, "decode steps are padded by pad_decode_plan"
    assert num_tokens >= plan.num_tokens and num_seqs >= plan.num_seqs, "a plan is padded only to a larger step"
    return padded_plan(plan, {"num_tokens": num_tokens, "num_seqs": num_seqs}, 0)


ALIGNMENT = 64  # bytes: each field's offset in a pack


class PackedInputs:
    """Every uploaded array of a step at a fixed offset in one host buffer (pinned on CUDA) and in its device twin of
    the same layout. A step writes its arrays into the host buffer, then one asynchronous copy moves the bytes up to
    the end of the block tables' last used row (nine separate copies cost the host ~0.2 ms per step on the H200). A
    field's device view never moves, so a CUDA graph captured on it reads each later step's values.

    Layout: the arrays of one value a row, then the block tables (the first table declared), in the one copy; each
    later table after them, in a copy of its own when the plan fills any of its rows.
    Each field holds as many rows as its kind's bound (max_tokens, max_seqs or max_samples, plus the kind's extra
    rows), and a table as many columns as its width: table_width for the block tables, `widths` for tables of other
    names."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        table_width: int,
        device: torch.device,
        plan_type: type[StepPlan] = StepPlan,
        widths: dict[str, int] | None = None,
        max_samples: int | None = None,
    ):
        """max_samples: sampled rows a step may have (None: max_seqs, one per sequence)."""
        self.plan_type = plan_type
        widths = {"table_width": table_width, **(widths or {})}
        bounds = {"tokens": max_tokens, "seqs": max_seqs, "samples": max_samples or max_seqs}
        specs = {name: spec for name, spec in plan_arrays(plan_type) if spec.upload}
        shapes: dict[str, tuple[int, ...]] = {}  # name -> (rows,) or (rows, columns)
        for name, spec in specs.items():
            assert spec.rows.bound is not None, f"{name}: its rows have no bound, so it cannot be uploaded"
            if spec.columns is None:
                columns = ()
            elif isinstance(spec.columns, str):
                assert spec.columns in widths, f"{name}: the step buffers need widths[{spec.columns!r}]"
                columns = (widths[spec.columns],)
            else:
                columns = (spec.columns,)
            shapes[name] = (bounds[spec.rows.bound] + spec.rows.extra, *columns)
        self.shapes = shapes
        tables = [name for name in shapes if len(shapes[name]) == 2]
        self.own_copy = set(tables[1:])
        self.layout: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes), in layout order
        offset = 0
        for name in sorted(shapes, key=lambda name: len(shapes[name])):  # stable: declaration order otherwise
            size = math.prod(shapes[name]) * np.dtype(specs[name].dtype).itemsize
            self.layout[name] = (offset, size)
            offset += -(-size // ALIGNMENT) * ALIGNMENT
        self.host_bytes = torch.zeros(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_bytes = torch.zeros(offset, dtype=torch.uint8, device=device)
        host = self.host_bytes.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (start, size) in self.layout.items():
            self.host[name] = host[start : start + size].view(specs[name].dtype).reshape(shapes[name])
            torch_dtype = torch.from_numpy(self.host[name]).dtype
            self.device[name] = self.device_bytes[start : start + size].view(torch_dtype).view(shapes[name])

    def holds(self, plan: StepPlan) -> bool:
        return all(len(getattr(plan, name)) <= shape[0] for name, shape in self.shapes.items())

    def upload(self, plan: StepPlan) -> StepInputs:
        """Write the plan into the host buffer and queue the copy (the caller makes sure the previous copy has left
        the host buffer)."""
        assert type(plan) is self.plan_type, f"a pack of {self.plan_type.__name__} fields got a {type(plan).__name__}"
        end, copies, arrays = 0, [], {}
        for name, host in self.host.items():
            array = getattr(plan, name)
            if array.ndim == 2:  # a plan's table may be narrower than the buffer's rows
                host[: len(array), : array.shape[1]] = array
            else:
                host[: len(array)] = array
            if len(array):
                start = self.layout[name][0]
                if name in self.own_copy:
                    copies.append((start, start + host[: len(array)].nbytes))
                else:
                    end = max(end, start + host[: len(array)].nbytes)
            arrays[name] = self.device[name][: len(array)]
        for start, stop in [(0, end), *copies]:
            self.device_bytes[start:stop].copy_(self.host_bytes[start:stop], non_blocking=True)
        # A padded prompt step has more sequences than block-table rows: its empty sequences' rows are never read.
        return StepInputs(arrays, attention_metadata(arrays, self.device["block_tables"][: plan.num_seqs], plan))

    def fill_padding(self, tokens_per_padding_seq: int) -> None:
        """Every row of the device buffers a padding row (graphs are captured on these): each field holds its pad
        value, query starts step by tokens_per_padding_seq."""
        specs = dict(plan_arrays(self.plan_type))
        for name, view in self.device.items():
            if specs[name].rows.token_offsets:
                view.copy_(torch.arange(len(view), dtype=view.dtype) * tokens_per_padding_seq)
            else:
                view.fill_(specs[name].pad)


class StepBuffers:
    """Two packs: one as large as a decode step can be (max_seqs tokens), which the CUDA graphs read, so a decode
    step copies little more than its block tables; one as large as any step (max_tokens), for the others."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        table_width: int,
        device: torch.device,
        plan_type: type[StepPlan] = StepPlan,
        widths: dict[str, int] | None = None,
        max_samples: int | None = None,
    ):
        """max_samples: sampled rows a step may have (None: max_seqs); a decode step samples at most max_seqs (a
        verify step, which samples more, is no decode step)."""
        self.decode = PackedInputs(max_seqs, max_seqs, table_width, device, plan_type, widths)
        self.decode.fill_padding(tokens_per_padding_seq=1)
        self.any_step = PackedInputs(max_tokens, max_seqs, table_width, device, plan_type, widths, max_samples)
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
    arrays = {name: torch.from_numpy(getattr(plan, name)) for name, spec in plan_arrays(type(plan)) if spec.upload}
    return StepInputs(arrays, attention_metadata(arrays, arrays["block_tables"], plan))
