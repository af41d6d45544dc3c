"""Rank 0 hands each step's plan to the other tensor-parallel ranks with two torch.distributed broadcasts on a CPU
(gloo) group: a header of the plan's scalars and array shapes (its size fixed by the plan's declarations), then
every broadcast array end to end in one int32 tensor (every value fits: token ids, positions, slots and block ids
are all far below 2^31; half the bytes of int64, and the block tables, most of a decode plan, need no conversion on
arrival). Nothing is pickled. The other ranks get neither the sampling part nor the arrays declared rank 0's alone.

Rank 0 does not wait for the broadcasts: gloo's own thread sends them while rank 0 runs its shard of the same step
(a gloo broadcast returns only once every rank has posted its receive, which would tie rank 0's host to the other
ranks' host loops). The receivers take each plan in order; broadcasts are matched by their sequence in the group.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.executor.plan_fields import PlanArray, plan_arrays, plan_scalars
from pagedllm.executor.step_plan import StepPlan

RUN_STEP, SHUT_DOWN = 1, 2


@cache
def broadcast_arrays(plan_type: type[StepPlan]) -> tuple[tuple[str, PlanArray], ...]:
    return tuple((name, spec) for name, spec in plan_arrays(plan_type) if spec.broadcast)


@cache
def shape_entries(plan_type: type[StepPlan]) -> tuple[tuple[str, int], ...]:
    """Each broadcast array and how many of its dimensions the header carries: its rows, and its columns where its
    width has a name."""
    return tuple((name, 1 + isinstance(spec.columns, str)) for name, spec in broadcast_arrays(plan_type))


@cache
def header_names(plan_type: type[StepPlan] = StepPlan) -> tuple[str, ...]:
    """The header's entries: the command, each scalar, then each broadcast array's rows (and its columns where its
    width has a name), in declaration order; the payload holds those arrays in the same order."""
    names = ["command", *(name for name, _ in plan_scalars(plan_type))]
    for name, dims in shape_entries(plan_type):
        names += [f"{name}.rows", f"{name}.columns"][:dims]
    return tuple(names)


def header_size(plan_type: type[StepPlan] = StepPlan) -> int:
    return len(header_names(plan_type))


def pack_plan(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a plan: an int64 header header_size(type(plan)) long and an int32 payload."""
    header = [RUN_STEP, *(int(getattr(plan, name)) for name, _ in plan_scalars(type(plan)))]
    arrays = []
    for name, dims in shape_entries(type(plan)):
        array = getattr(plan, name)
        header += array.shape[:dims]
        arrays.append(array.ravel())
    return torch.tensor(header, dtype=torch.int64), torch.from_numpy(np.concatenate(arrays, dtype=np.int32))


def array_shapes(header: list[int], plan_type: type[StepPlan]) -> dict[str, tuple[int, ...]]:
    """The shape of each of the payload's arrays, in the order pack_plan concatenates them."""
    values = dict(zip(header_names(plan_type), header))
    shapes = {}
    for name, spec in broadcast_arrays(plan_type):
        rows = values[f"{name}.rows"]
        if spec.columns is None:
            shapes[name] = (rows,)
        else:
            shapes[name] = (rows, values[f"{name}.columns"] if isinstance(spec.columns, str) else spec.columns)
    return shapes


def unpack_plan(header: list[int], payload: np.ndarray, plan_type: type[StepPlan] = StepPlan) -> StepPlan:
    """The plan pack_plan packed; its fields that are not broadcast (the sampling part, rank 0's arrays) are left
    empty."""
    fields = {name: kind(value) for (name, kind), value in zip(plan_scalars(plan_type), header[1:])}
    offset, specs = 0, dict(plan_arrays(plan_type))
    for name, shape in array_shapes(header, plan_type).items():
        size = math.prod(shape)
        fields[name] = payload[offset : offset + size].reshape(shape).astype(specs[name].dtype, copy=False)
        offset += size
    return plan_type(**fields)


class PlanSender:
    """Rank 0's side. Invariant: at most one plan's broadcasts are in flight, and their tensors stay referenced
    here until they complete (gloo reads them from its thread)."""

    def __init__(self, group: dist.ProcessGroup, plan_type: type[StepPlan] = StepPlan):
        self.group, self.plan_type = group, plan_type
        self.in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, plan: StepPlan) -> None:
        """Queue the plan's broadcasts and return at once (after the previous plan's have completed)."""
        assert type(plan) is self.plan_type, f"a sender of {self.plan_type.__name__} got a {type(plan).__name__}"
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
        header = torch.zeros(header_size(self.plan_type), dtype=torch.int64)
        header[0] = SHUT_DOWN
        dist.broadcast(header, src=0, group=self.group)


def receive_plan(group: dist.ProcessGroup, plan_type: type[StepPlan] = StepPlan) -> StepPlan | None:
    """The next plan from rank 0 (waiting as long as it takes); None when rank 0 shuts the group down."""
    header = torch.empty(header_size(plan_type), dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    values = header.tolist()
    if values[0] == SHUT_DOWN:
        return None
    assert values[0] == RUN_STEP, f"unknown plan command {values[0]}"
    payload = torch.empty(sum(map(math.prod, array_shapes(values, plan_type).values())), dtype=torch.int32)
    dist.broadcast(payload, src=0, group=group)
    return unpack_plan(values, payload.numpy(), plan_type)
