"""How a StepPlan field is declared: each array's dtype, row kind, pad value and destinations, each scalar's type.
Packing, upload, the broadcast, padding and the graph buffers read these declarations; none lists the fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass(frozen=True, slots=True)
class RowKind:
    """What an array has one row of. The arrays of one kind that a plan sets have the same number of rows."""

    count: str  # the name of the plan's number of such rows (padding names the counts it extends)
    bound: str | None  # what step buffers hold at most of them: "tokens", "seqs" or "samples"; None: never uploaded
    extra: int = 0  # rows past the count
    # Each row is where a sequence's tokens start among the packed rows, the last where they end: padding
    # sequences continue from the end.
    token_offsets: bool = False


TOKENS = RowKind("num_tokens", "tokens")
SEQS = RowKind("num_seqs", "seqs")
QUERY_STARTS = RowKind("num_seqs", "seqs", extra=1, token_offsets=True)
# A block-table row per sequence, except the empty sequences that pad a prompt step: their rows are never read.
TABLE_ROWS = RowKind("num_table_rows", "seqs")
# One per state index, and with speculative decoding k more per verifying sequence: ResolvedConfig.max_sampled_rows.
SAMPLED = RowKind("num_sampled", "samples")
PLACEHOLDERS = RowKind("num_placeholders", "seqs")
MASKED = RowKind("num_masked", "samples")  # the sampled rows a grammar constrains (structured outputs): some of SAMPLED
PROMPT_LOGPROB_ROWS = RowKind("num_prompt_logprob_rows", "tokens")
BLOCK_COPIES = RowKind("num_block_copies", None)


@dataclass(frozen=True, slots=True)
class PlanArray:
    dtype: type
    rows: RowKind
    # None: one value a row. An int: that many columns. A name: as many columns as the plan's array has (the
    # broadcast header carries them), up to the width of that name the step buffers are built with.
    columns: int | str | None
    pad: int  # what padding rows hold, and every row of the graphs' buffers while they are captured
    upload: bool  # in the packed buffers that go to the device each step
    broadcast: bool  # sent to the other tensor-parallel ranks (values must fit int32); else rank 0's alone

    def empty(self) -> np.ndarray:
        """No rows: what a plan holds when its producer sets nothing, and other ranks get when not broadcast."""
        columns = () if self.columns is None else (self.columns if isinstance(self.columns, int) else 0,)
        return np.zeros((0, *columns), dtype=self.dtype)


def plan_array(
    dtype: type,
    rows: RowKind,
    *,
    columns: int | str | None = None,
    pad: int = 0,
    upload: bool = True,
    broadcast: bool = True,
) -> dataclasses.Field:
    """A StepPlan array field (empty by default)."""
    spec = PlanArray(dtype, rows, columns, pad, upload, broadcast)
    return dataclasses.field(default_factory=spec.empty, metadata={"plan_array": spec})


def plan_scalar(kind: type) -> dataclasses.Field:
    """A StepPlan scalar field (int or bool), carried in the broadcast header."""
    return dataclasses.field(metadata={"plan_scalar": kind})


@cache
def plan_arrays(plan_type: type) -> tuple[tuple[str, PlanArray], ...]:
    """The plan type's array fields in declaration order."""
    fields = dataclasses.fields(plan_type)
    return tuple((field.name, field.metadata["plan_array"]) for field in fields if "plan_array" in field.metadata)


@cache
def plan_scalars(plan_type: type) -> tuple[tuple[str, type], ...]:
    fields = dataclasses.fields(plan_type)
    return tuple((field.name, field.metadata["plan_scalar"]) for field in fields if "plan_scalar" in field.metadata)


def check_plan(plan) -> None:
    """Every array has its declared dtype and shape, and the arrays of a kind that have rows agree on their count (an
    array with no rows is one its producer did not set)."""
    counts: dict[str, int] = {}
    for name, spec in plan_arrays(type(plan)):
        array = getattr(plan, name)
        assert array.dtype == spec.dtype, f"{name} is {array.dtype}, declared {np.dtype(spec.dtype)}"
        assert array.ndim == (1 if spec.columns is None else 2), f"{name} has {array.ndim} dimensions"
        assert not isinstance(spec.columns, int) or array.shape[1] == spec.columns, f"{name}: {array.shape}"
        if len(array):
            count = len(array) - spec.rows.extra
            assert counts.setdefault(spec.rows.count, count) == count, f"{name}: {count} {spec.rows.count}"
