"""A plan survives packing into the broadcast's header and payload: every array, length and flag; its sampling part
(rank 0's alone) stays behind."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.executor.plan_broadcast import header_size, pack_plan, unpack_plan
from pagedllm.executor.plan_fields import plan_arrays, plan_scalars
from pagedllm.executor.step_plan import StepPlan, StepSampling
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams

ARRAYS = tuple(name for name, spec in plan_arrays(StepPlan) if spec.broadcast)
# What every rank reads today; whatever a later field declares comes on top.
RANKS_READ = {"input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "sample_rows",
              "placeholder_rows", "placeholder_sources", "prompt_logprob_rows", "block_copies"}  # fmt: skip


def make_plan(num_new_tokens: list[int], width: int, placeholders: list[int], num_copies: int) -> StepPlan:
    rng = np.random.default_rng(len(num_new_tokens))
    num_seqs, num_tokens = len(num_new_tokens), sum(num_new_tokens)
    query_start_loc = np.concatenate([[0], np.cumsum(num_new_tokens)]).astype(np.int32)
    return StepPlan(
        step_id=41,
        input_ids=rng.integers(-1, 50_000, num_tokens),
        positions=rng.integers(0, 4096, num_tokens),
        slot_mapping=rng.integers(-1, 1 << 20, num_tokens),
        query_start_loc=query_start_loc,
        seq_lens=rng.integers(1, 4096, num_seqs).astype(np.int32),
        block_tables=rng.integers(0, 1 << 16, (num_seqs, width)).astype(np.int32),
        sample_rows=query_start_loc[1:].astype(np.int64) - 1,
        max_query_len=max(num_new_tokens),
        max_seq_len=4095,
        decode_only=all(n == 1 for n in num_new_tokens),
        placeholder_rows=np.array(placeholders, dtype=np.int64),
        placeholder_sources=np.arange(len(placeholders), dtype=np.int64),
        sampling=StepSampling(build_sampling_batch([SamplingParams()] * num_seqs), np.arange(num_seqs)),
        prompt_logprob_rows=np.arange(0, num_tokens, 3, dtype=np.int64),
        block_copies=rng.integers(0, 1 << 16, (num_copies, 2)),
    )


@pytest.mark.parametrize(
    ("num_new_tokens", "width", "placeholders", "num_copies"),
    [([5, 1, 30], 3, [], 2), ([1, 1, 1, 1], 7, [0, 2, 3], 0), ([1], 1, [0], 1), ([100], 12, [], 0)],
)
def test_unpacked_plan_equals_the_packed_one(num_new_tokens, width, placeholders, num_copies):
    plan = make_plan(num_new_tokens, width, placeholders, num_copies)
    header, payload = pack_plan(plan)
    assert header.shape == (header_size(StepPlan),)
    received = unpack_plan(header.tolist(), payload.numpy())
    assert RANKS_READ.issubset(ARRAYS)
    for name, spec in plan_arrays(StepPlan):
        sent, got = getattr(plan, name), getattr(received, name)
        assert got.dtype == sent.dtype and np.array_equal(got, sent if spec.broadcast else spec.empty()), name
    for name, _ in plan_scalars(StepPlan):
        assert getattr(received, name) == getattr(plan, name), name
    assert received.sampling is None  # only rank 0 samples


RECEIVER_DELAY_S = 3.0


def plan_sender_ranks(rank: int, store_path: str, results) -> None:
    """Rank 0 sends three plans and the shutdown while rank 1 starts receiving only after RECEIVER_DELAY_S."""
    import time

    import torch.distributed as dist

    from pagedllm.executor.plan_broadcast import PlanSender, receive_plan

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    plans = [make_plan([3, 1], 2, [1], 1), make_plan([1, 1, 1], 4, [], 0), make_plan([7], 1, [0], 2)]
    for step_id, plan in enumerate(plans):
        plan.step_id = step_id
    if rank == 0:
        sender = PlanSender(dist.group.WORLD)
        start = time.perf_counter()
        sender.send(plans[0])
        results["first_send_s"] = time.perf_counter() - start
        for plan in plans[1:]:
            sender.send(plan)
        sender.send_shutdown()
    else:
        time.sleep(RECEIVER_DELAY_S)
        received = []
        while (plan := receive_plan(dist.group.WORLD)) is not None:
            received.append(plan)
        results["received"] = [(plan.step_id, *(getattr(plan, name).tolist() for name in ARRAYS)) for plan in received]
        results["expected"] = [(plan.step_id, *(getattr(plan, name).tolist() for name in ARRAYS)) for plan in plans]
    dist.destroy_process_group()


def test_plan_sender_does_not_wait_for_the_receivers_and_keeps_the_order(tmp_path):
    """Rank 0 goes on while the other ranks are still busy (gloo's thread sends); every plan arrives, in order,
    then the shutdown."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(plan_sender_ranks, args=(str(tmp_path / "store"), results), nprocs=2)
        assert results["first_send_s"] < RECEIVER_DELAY_S / 2
        assert results["received"] == results["expected"]
