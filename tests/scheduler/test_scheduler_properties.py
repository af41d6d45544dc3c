"""Property-based tests: random add / step / abort sequences keep the scheduler's and block manager's invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48

# prompts drawn from a tiny alphabet with shared starts, so prefix-cache hits and hash chains are exercised
prompt_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=30)
operation = st.one_of(
    st.tuples(st.just("add"), prompt_strategy, st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(0, 5)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def check(scheduler: Scheduler, all_seqs: list[Sequence]) -> None:
    block_manager = scheduler.block_manager
    block_manager.check_invariants(holders=scheduler.running)
    assert len(scheduler.running) <= scheduler.max_num_seqs
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


def run_step(scheduler: Scheduler, sampled_token: int) -> None:
    batch = scheduler.schedule()
    assert batch.num_tokens <= scheduler.max_num_batched_tokens
    assert len(set(map(id, batch.seqs))) == len(batch.seqs)
    for seq, num_new_tokens in zip(batch.seqs, batch.num_new_tokens):
        assert 1 <= num_new_tokens <= seq.num_uncomputed_tokens
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens + num_new_tokens
    num_sampled = sum(seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens))
    # the engine's synchronous step: advance, then hand each sampling sequence its token
    scheduler.append_tokens(scheduler.advance(batch), [sampled_token] * num_sampled)


def run_program(operations, scheduler: Scheduler, step, busy) -> list[Sequence]:
    """Apply add / step / abort operations, checking the invariants after each, then drain: everything still
    queued must finish (no request starves or hangs) and every block must come back."""
    block_manager = scheduler.block_manager
    all_seqs: list[Sequence] = []
    for op in operations:
        if op[0] == "add":
            _, prompt, max_tokens = op
            # the engine rejects requests that could never fit; mirror that rule here
            if (
                block_manager.blocks_for_tokens(min(len(prompt) + max_tokens, MAX_MODEL_LEN))
                <= block_manager.num_blocks
            ):
                seq = Sequence(str(len(all_seqs)), list(prompt), SamplingParams(max_tokens=max_tokens))
                all_seqs.append(seq)
                scheduler.add(seq)
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
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
)
def test_random_operations_keep_invariants(operations, num_blocks, budget, max_num_seqs, prefix_caching):
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, budget, MAX_MODEL_LEN)
    run_program(operations, scheduler, lambda token: run_step(scheduler, token), scheduler.has_unfinished)


def test_prefix_hit_reuses_freed_blocks_and_skips_collisions():
    block_manager = BlockManager(8, BLOCK_SIZE)
    scheduler = Scheduler(block_manager, 4, 64, MAX_MODEL_LEN)
    first = Sequence("a", list(range(10)), SamplingParams(max_tokens=1))
    scheduler.add(first)
    run_step(scheduler, 0)
    assert first.is_finished and block_manager.num_free_blocks == 8
    second = Sequence("b", list(range(9)) + [99], SamplingParams(max_tokens=1))
    assert block_manager.find_cached_prefix(second) == [0, 1]  # two full blocks of the first request
    block_manager.blocks[1].token_ids = (7, 7, 7, 7)  # as if the hash of block 1 collided with other tokens
    assert block_manager.find_cached_prefix(second) == [0]


class OverlappedSteps:
    """The engine's async protocol at the scheduler level: step N+1 is scheduled while step N's tokens are
    placeholders; they are filled in one step later; no scheduling ahead when a preemption could be needed."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.in_flight: list[Sequence] | None = None

    def resolve(self, token: int) -> None:
        if self.in_flight is not None:
            live = [seq for seq in self.in_flight if not seq.is_finished]
            self.scheduler.append_tokens(live, [token] * len(live))
            self.in_flight = None

    def step(self, token: int) -> None:
        if self.in_flight is not None and not self.scheduler.can_schedule_ahead():
            self.resolve(token)
            return
        batch = self.scheduler.schedule()
        assert batch.num_tokens <= self.scheduler.max_num_batched_tokens
        self.resolve(token)
        if not batch.is_empty():
            sampling = self.scheduler.advance(batch)
            self.scheduler.append_placeholders(sampling)
            self.in_flight = sampling

    def busy(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(operation, max_size=60),
    num_blocks=st.integers(6, 24),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 8),
)
def test_overlapped_steps_keep_invariants(operations, num_blocks, budget, max_num_seqs):
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE), max_num_seqs, budget, MAX_MODEL_LEN)
    steps = OverlappedSteps(scheduler)
    all_seqs = run_program(operations, scheduler, steps.step, steps.busy)
    for seq in all_seqs:  # every sequence that was not aborted ended with real tokens, within its limits
        if seq.finish_reason == "abort":
            continue
        assert -1 not in seq.token_ids
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens == MAX_MODEL_LEN
