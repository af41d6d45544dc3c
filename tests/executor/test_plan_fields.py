"""Fields declared once, here only (DraftPlan extends StepPlan), go through padding, the packed upload, the CPU wrap,
the graphs' padding rows and the broadcast with no other change: no step between a plan's producer and its
consumer lists the plan's fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_step_inputs import make_plan as random_plan

from pagedllm.executor.cuda_graphs import DecodeGraphs, PrefillGraphs
from pagedllm.executor.plan_broadcast import header_size, pack_plan, unpack_plan
from pagedllm.executor.plan_fields import SAMPLED, SEQS, check_plan, plan_array, plan_arrays, plan_scalar
from pagedllm.executor.step_inputs import PackedInputs, StepBuffers, pad_decode_plan, pad_prefill_plan, wrap_plan
from pagedllm.executor.step_plan import StepPlan

CPU = torch.device("cpu")
WIDTH, DRAFTS, WORDS = 6, 3, 4
WIDTHS = {"max_draft_tokens": DRAFTS, "bitmask_words": WORDS}


@dataclass(slots=True, kw_only=True)
class DraftPlan(StepPlan):
    num_draft_steps: int = plan_scalar(int)
    # Every rank reads it on the device; -1 past a sequence's drafts, and in padding sequences.
    draft_token_ids: np.ndarray = plan_array(np.int64, SEQS, columns="max_draft_tokens", pad=-1)
    # Rank 0's alone, read on the device: one row of 32-token words per sampled row.
    token_bitmask: np.ndarray = plan_array(np.int32, SAMPLED, columns="bitmask_words", broadcast=False)


def make_plan(query_lens: list[int], seed: int, width: int = WIDTH) -> DraftPlan:
    """test_step_inputs' random plan, with the fields declared here filled in too."""
    base = random_plan(query_lens, seed, width)
    rng = np.random.default_rng(seed + 1)
    num_seqs = len(query_lens)
    extra = dict(
        num_draft_steps=2,
        draft_token_ids=rng.integers(0, 1000, (num_seqs, DRAFTS)),
        token_bitmask=rng.integers(-(2**31), 2**31, (num_seqs, WORDS)).astype(np.int32),
    )
    inherited = {field.name: getattr(base, field.name) for field in fields(StepPlan) if field.name not in extra}
    return DraftPlan(**inherited, **extra)


def copies(plan: StepPlan) -> dict[str, np.ndarray]:
    return {name: getattr(plan, name).copy() for name, _ in plan_arrays(type(plan))}


PADDINGS = {
    "decode": (lambda: make_plan([1, 1, 1], 1), lambda plan: pad_decode_plan(plan, 8)),
    "prefill": (lambda: make_plan([5, 1, 30], 2), lambda plan: pad_prefill_plan(plan, num_tokens=64, num_seqs=8)),
}


@pytest.fixture(params=list(PADDINGS))
def plans(request) -> tuple[DraftPlan, DraftPlan]:
    """(a plan, that plan padded), checked against the declarations."""
    make, pad = PADDINGS[request.param]
    plan = make()
    before = copies(plan)
    padded = pad(plan)
    for name, array in before.items():  # a new plan: the one handed in is left as it was
        assert np.array_equal(getattr(plan, name), array), name
    check_plan(plan)
    check_plan(padded)
    return plan, padded


def test_padding_extends_a_declared_field_with_its_pad_value(plans):
    plan, padded = plans
    assert type(padded) is DraftPlan and padded.num_draft_steps == 2
    assert padded.num_seqs == 8 and padded.draft_token_ids.shape == (8, DRAFTS)
    assert np.array_equal(padded.draft_token_ids[: plan.num_seqs], plan.draft_token_ids)
    assert (padded.draft_token_ids[plan.num_seqs :] == -1).all()
    assert (padded.slot_mapping[plan.num_tokens :] == -1).all()
    assert padded.token_bitmask is plan.token_bitmask  # sampled rows are not padded


def test_the_packed_upload_and_the_cpu_wrap_carry_the_declared_fields(plans):
    _, padded = plans
    pack = PackedInputs(max_tokens=64, max_seqs=8, table_width=WIDTH, device=CPU, plan_type=DraftPlan, widths=WIDTHS)
    for inputs in (pack.upload(padded), wrap_plan(padded)):
        assert inputs.draft_token_ids.tolist() == padded.draft_token_ids.tolist()
        assert inputs.token_bitmask.tolist() == padded.token_bitmask.tolist()
        assert inputs.input_ids.tolist() == padded.input_ids.tolist()
    later = make_plan([2, 2], 3)  # another step through the same pack: each field reads back its own rows
    inputs = pack.upload(later)
    assert inputs.draft_token_ids.tolist() == later.draft_token_ids.tolist()
    assert inputs.token_bitmask.tolist() == later.token_bitmask.tolist()
    assert inputs.metadata.block_tables.tolist() == later.block_tables.tolist()


def test_graph_buffers_start_as_padding_rows_of_every_declared_field():
    buffers = StepBuffers(64, 8, WIDTH, CPU, plan_type=DraftPlan, widths=WIDTHS)
    assert (buffers.decode.device["draft_token_ids"] == -1).all()
    model = torch.nn.Linear(2, 2)
    model.spec = SimpleNamespace(hidden_size=2)
    for graphs, starts in [
        (DecodeGraphs(model, buffers, 8, 64), list(range(9))),
        (PrefillGraphs(model, buffers, [16, 32], 8, 64), [0] * 9),
    ]:
        graphs.pack.upload(make_plan([1] * 4, 4))  # a step leaves its values behind
        graphs.empty_inputs()  # as before a capture
        device = graphs.pack.device
        assert (device["draft_token_ids"] == -1).all() and (device["slot_mapping"] == -1).all()
        assert (device["token_bitmask"] == 0).all() and (device["seq_lens"] == 0).all()
        assert device["query_start_loc"].tolist() == starts


def assert_received(received: StepPlan, sent: StepPlan) -> None:
    """Every broadcast array and scalar as sent; the arrays rank 0 keeps arrive empty."""
    assert type(received) is DraftPlan and received.sampling is None
    for name, spec in plan_arrays(DraftPlan):
        expected = getattr(sent, name) if spec.broadcast else spec.empty()
        got = getattr(received, name)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), name
    assert received.token_bitmask.shape == (0, 0)
    assert (received.step_id, received.num_draft_steps, received.decode_only) == (
        sent.step_id,
        sent.num_draft_steps,
        sent.decode_only,
    )


def test_the_broadcast_carries_the_declared_fields(plans):
    _, padded = plans
    header, payload = pack_plan(padded)
    # the extra scalar, and the rows and columns of the broadcast table
    assert header.shape == (header_size(DraftPlan),) and header_size(DraftPlan) == header_size(StepPlan) + 3
    received = unpack_plan(header.tolist(), payload.numpy(), DraftPlan)
    assert_received(received, padded)
    assert (received.draft_token_ids[3:] == -1).all()
    check_plan(received)


def draft_plan_ranks(rank: int, store_path: str, results) -> None:
    import torch.distributed as dist

    from pagedllm.executor.plan_broadcast import PlanSender, receive_plan

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    plans = [pad_decode_plan(make_plan([1, 1, 1], 5), 4), make_plan([3, 9], 6)]
    if rank == 0:
        sender = PlanSender(dist.group.WORLD, DraftPlan)
        for plan in plans:
            sender.send(plan)
        sender.send_shutdown()
        sender.wait()
    else:
        received = []
        while (plan := receive_plan(dist.group.WORLD, DraftPlan)) is not None:
            received.append(plan)
        assert len(received) == len(plans)
        for got, sent in zip(received, plans):
            assert_received(got, sent)
        results["checked"] = len(received)
    dist.destroy_process_group()


def test_declared_fields_reach_the_other_ranks_over_gloo(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(draft_plan_ranks, args=(str(tmp_path / "store"), results), nprocs=2)
        assert results["checked"] == 2
