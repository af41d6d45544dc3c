"""Property-based tests of speculative decoding's rollback: random add / step / abort programs in which every
sequence that may verify proposes a random number of drafts, of which a random number are right, keep the scheduler's
and block manager's invariants (test_scheduler_properties.check) and these: no draft outlives its step, a running
sequence holds exactly the blocks its computed tokens fill (rejected lookahead goes back to the pool), and every
token a request gets is its own (a rejected draft never reaches the output)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import BLOCK_SIZE, MAX_BUDGET, MAX_MODEL_LEN, make_pipeline, operation, run_program

from pagedllm.config import SpeculativeConfig
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.spec_decode.speculator import NONE_PROPOSED, Proposal, Speculator, can_verify

MAX_DRAFTS = 5
WRONG = 1000  # a draft token the fake worker never samples (it samples each request's signature, its id)


class RandomDrafts(Speculator):
    """Proposes up to MAX_DRAFTS drafts for every sequence that may verify: the first `right` of them are the token the
    fake worker will sample (so they are accepted), the rest WRONG."""

    def __init__(self, rng: random.Random):
        super().__init__(SpeculativeConfig("ngram", MAX_DRAFTS, 1, 1))
        self.rng = rng

    def propose(self, scheduler: Scheduler) -> Proposal:
        for seq in scheduler.running:
            if can_verify(seq):
                count = self.rng.randint(0, MAX_DRAFTS)
                right = self.rng.randint(0, count)
                seq.draft_token_ids = [int(seq.request_id)] * right + [WRONG] * (count - right)
        return Proposal(NONE_PROPOSED)


def check_rollback(scheduler: Scheduler) -> None:
    """Beside run_program's check of every sequence after each operation."""
    block_manager = scheduler.block_manager
    for seq in [*scheduler.running, *scheduler.waiting]:
        assert not seq.draft_token_ids, "a draft outlived its step"
    for seq in scheduler.running:
        assert len(seq.block_table) == block_manager.blocks_for_tokens(seq.num_computed_tokens)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    operations=st.lists(operation, max_size=60),
    num_blocks=st.integers(6, 24),
    budget=st.integers(1, MAX_BUDGET),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_accept_lengths_keep_the_block_managers_invariants(
    operations, num_blocks, budget, max_num_seqs, prefix_caching, overlap, seed
):
    scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, budget, MAX_MODEL_LEN)
    pipeline, _ = make_pipeline(scheduler, overlap=overlap)
    pipeline.speculator = RandomDrafts(random.Random(seed))
    verified = []

    def step(_: int) -> None:
        result = pipeline.step()
        if result.record is not None:
            verified.append((result.record.num_draft_tokens, result.record.num_accepted_tokens))
        check_rollback(scheduler)

    all_seqs = run_program(operations, scheduler, step, pipeline.has_work)
    for seq in all_seqs:  # a request that was not aborted ended at its stop token or its length, exactly
        if seq.finish_reason == "length":
            assert seq.num_tokens == seq.max_num_tokens
        assert seq.num_tokens <= seq.max_num_tokens
    assert all(accepted <= proposed for proposed, accepted in verified)
