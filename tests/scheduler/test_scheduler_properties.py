"""Property-based tests: random add / step / abort programs, run through the engine's own step protocol
(StepPipeline, synchronous and overlapped) on a fake device, keep the scheduler's and block manager's invariants,
also for requests of several samples (n > 1: shared blocks, forks, copy-on-write) and their state indices."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine.step_pipeline import StepPipeline
from pagedllm.executor.executor import Executor
from pagedllm.executor.plan_fields import check_plan
from pagedllm.executor.step_output import StepOutput
from pagedllm.executor.step_plan import StepPlan
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import SamplerOutput
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import PLACEHOLDER, Sequence, SequenceStatus

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
MAX_BUDGET = 24

# prompts drawn from a tiny alphabet with shared starts, so prefix-cache hits and hash chains are exercised
prompt_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=30)
operation = st.one_of(
    st.tuples(st.just("add"), prompt_strategy, st.integers(1, 12), st.booleans(), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(0, 5)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def check(scheduler: Scheduler, all_seqs: list[Sequence]) -> None:
    block_manager = scheduler.block_manager
    block_manager.check_invariants(holders=scheduler.running)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    # A state index is held from first admission to the end, by one sequence at a time: running ones hold one, finished
    # ones none, and held plus free state indices are all of them.
    state_indices = [seq.state_index for seq in all_seqs if seq.state_index >= 0]
    assert sorted(state_indices + scheduler.free_state_indices) == list(range(scheduler.max_num_seqs))
    assert all(seq.state_index >= 0 for seq in scheduler.running)
    assert all(seq.state_index == -1 for seq in all_seqs if seq.is_finished)
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
        assert seq.num_computed_tokens <= seq.num_tokens <= MAX_MODEL_LEN
        for index in range(seq.num_hashed_blocks):  # hashed blocks hold exactly the sequence's tokens
            block = block_manager.blocks[seq.block_table[index]]
            assert block.token_ids == tuple(seq.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
    for seq in all_seqs:
        if seq.is_finished:
            assert not seq.block_table
        outputs = seq.output_token_ids
        if outputs and outputs[-1] == PLACEHOLDER:
            assert seq.pending_sample_index >= 0 and seq.finish_reason in (None, "abort")
            outputs = outputs[:-1]
        assert set(outputs) <= {int(seq.request_id)}, f"request {seq.request_id} got another's tokens: {outputs}"


class FakeWorker:
    """An Executor standing in for the device: each sampled row gets its request's signature token (the request id
    as an int), so a token handed to the wrong sequence shows. It checks what a real worker relies on: a placeholder
    input is filled from a row of the step in flight, and only there; a row's state index was registered for its request
    and not released since, and no state index is held twice."""

    device = torch.device("cpu")

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks
        self.state_owners: dict[int, str] = {}  # state index -> request id, as the sampler would hold state there

    def set_device_timings(self, on: bool) -> None:
        """No device: nothing to time."""

    def shutdown(self) -> None:
        """Holds nothing."""

    def execute(self, plan: StepPlan, previous: StepOutput | None = None, masks=None) -> StepOutput:
        assert masks is None, "no request here is constrained"
        check_plan(plan)  # each array of the dtype, shape and rows its field declares
        placeholder_rows = set(plan.placeholder_rows.tolist())
        assert placeholder_rows == {row for row, token in enumerate(plan.input_ids) if token == PLACEHOLDER}
        if placeholder_rows:
            assert previous is not None
            assert all(0 <= source < len(previous.token_ids()) for source in plan.placeholder_sources)
        assert plan.num_tokens <= MAX_BUDGET
        for state_index in plan.sampling.released_state_indices:
            del self.state_owners[state_index]
        for request in plan.sampling.new_requests:
            assert request.state_index not in self.state_owners, f"state index {request.state_index} is held twice"
            self.state_owners[request.state_index] = request.request_id
        signatures = [int(self.state_owners[state_index]) for state_index in plan.sampling.row_state_indices.tolist()]
        return StepOutput(plan.step_id, SamplerOutput(torch.tensor(signatures, dtype=torch.int64)))


def make_pipeline(scheduler: Scheduler, overlap: bool) -> tuple[StepPipeline, FakeWorker]:
    worker = FakeWorker(scheduler.block_manager.num_blocks)
    assert isinstance(worker, Executor)
    return StepPipeline(scheduler, worker, overlap), worker


def pipeline_stepper(pipeline: StepPipeline):
    def step(_: int) -> None:
        scheduler = pipeline.scheduler
        ahead = pipeline.in_flight is not None and scheduler.can_schedule_ahead()
        preemptions = scheduler.num_preemptions
        pipeline.step()
        if ahead:  # the step scheduled while another was in flight: it must not have preempted
            assert scheduler.num_preemptions == preemptions, "can_schedule_ahead() said yes, the schedule preempted"

    return step


def run_program(operations, scheduler: Scheduler, step, busy) -> list[Sequence]:
    """Apply add / step / abort operations, checking the invariants after each, then drain: everything still
    queued must finish (no request starves or hangs) and every block must come back."""
    block_manager = scheduler.block_manager
    all_seqs: list[Sequence] = []
    for op in operations:
        if op[0] == "add":
            _, prompt, max_tokens, stops, num_samples = op
            # the engine rejects requests that could never fit or have more samples than state indices; mirror that here
            if (
                block_manager.blocks_for_tokens(min(len(prompt) + max_tokens, MAX_MODEL_LEN))
                <= block_manager.num_blocks
                and num_samples <= scheduler.max_num_seqs
            ):
                signature = len(all_seqs)  # the fake worker samples this token for this request: a stop when asked
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[signature] if stops else [])
                samples = [Sequence(str(signature), list(prompt), params, sample_index=i) for i in range(num_samples)]
                samples[0].forks = samples[1:]
                all_seqs += samples
                scheduler.add(samples[0])
        elif op[0] == "step":
            step(op[1])
        elif all_seqs:
            scheduler.abort(all_seqs[op[1] % len(all_seqs)].request_id)
        check(scheduler, all_seqs)
    for _ in range(2000):
        if not busy():
            break
        step(0)
        check(scheduler, all_seqs)
    assert not busy()
    assert block_manager.num_free_blocks == block_manager.num_blocks
    return all_seqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(operation, max_size=60),
    num_blocks=st.integers(6, 24),
    budget=st.integers(1, MAX_BUDGET),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
)
def test_random_operations_keep_invariants(operations, num_blocks, budget, max_num_seqs, prefix_caching):
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, budget, MAX_MODEL_LEN)
    pipeline, _ = make_pipeline(scheduler, overlap=False)
    run_program(operations, scheduler, pipeline_stepper(pipeline), pipeline.has_work)


def test_prefix_hit_reuses_freed_blocks_and_skips_collisions():
    block_manager = BlockManager(8, BLOCK_SIZE)
    scheduler = Scheduler(block_manager, 4, 64, MAX_MODEL_LEN)
    first = Sequence("0", list(range(10)), SamplingParams(max_tokens=1))
    scheduler.add(first)
    pipeline, _ = make_pipeline(scheduler, overlap=False)
    pipeline.step()
    assert first.is_finished and block_manager.num_free_blocks == 8
    second = Sequence("1", list(range(9)) + [99], SamplingParams(max_tokens=1))
    assert block_manager.find_cached_prefix(second) == [0, 1]  # two full blocks of the first request
    block_manager.blocks[1].token_ids = (7, 7, 7, 7)  # as if the hash of block 1 collided with other tokens
    assert block_manager.find_cached_prefix(second) == [0]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(operation, max_size=60),
    num_blocks=st.integers(6, 24),
    budget=st.integers(1, MAX_BUDGET),
    max_num_seqs=st.integers(1, 8),
)
def test_overlapped_steps_keep_invariants(operations, num_blocks, budget, max_num_seqs):
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE), max_num_seqs, budget, MAX_MODEL_LEN)
    pipeline, _ = make_pipeline(scheduler, overlap=True)
    all_seqs = run_program(operations, scheduler, pipeline_stepper(pipeline), pipeline.has_work)
    for seq in all_seqs:  # every sequence that was not aborted ended with real tokens, within its limits
        if seq.finish_reason == "abort":
            continue
        assert -1 not in seq.token_ids
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens == MAX_MODEL_LEN


def test_a_step_scheduled_ahead_never_preempts():
    """Small caches and long outputs under overlapped steps: preemptions happen, and never in a step that
    can_schedule_ahead() let the pipeline schedule while another was in flight (the stepper checks each step)."""
    rng = random.Random(0)
    preemptions = 0
    for _ in range(40):
        block_manager = BlockManager(rng.randint(6, 16), BLOCK_SIZE)
        scheduler = Scheduler(block_manager, rng.randint(2, 8), rng.randint(4, MAX_BUDGET), MAX_MODEL_LEN)
        pipeline, _ = make_pipeline(scheduler, overlap=True)
        adds = [("add", [rng.randint(0, 2) for _ in range(rng.randint(1, 20))], rng.randint(4, 12), False, 1)]
        run_program(adds * 8, scheduler, pipeline_stepper(pipeline), pipeline.has_work)
        preemptions += scheduler.num_preemptions
    assert preemptions > 0
