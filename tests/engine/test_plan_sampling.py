"""A plan's sampling batch is built again only when it can differ from the previous plan's: the same sequences in
the same order reuse it; another sequence, another order, or a row with min_tokens (whose bans follow its output
count) get a fresh one with their own settings."""

from __future__ import annotations

import numpy as np

from pagedllm import SamplingParams
from pagedllm.engine.plan_builder import LastSamplingBatch, step_sampling
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence

EOS = 2


def sequence(name: str, slot: int, **params) -> Sequence:
    seq = Sequence(name, [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    seq.slot = slot
    return seq


def sample(owners: list[Sequence], last: LastSamplingBatch):
    return step_sampling(ScheduledBatch(list(owners), [1] * len(owners)), owners, [], last).batch


def test_same_sequences_reuse_the_batch_and_any_change_rebuilds_it():
    last = LastSamplingBatch()
    a, b, c = sequence("a", 0, temperature=0.5), sequence("b", 1, temperature=0), sequence("c", 2, temperature=0.9)
    first = sample([a, b], last)
    assert sample([a, b], last) is first  # a decode step for the same sequences
    np.testing.assert_array_equal(sample([b, a], last).temperatures, np.float32([0, 0.5]))
    replaced = sample([a, c], last)
    np.testing.assert_array_equal(replaced.temperatures, np.float32([0.5, 0.9]))
    assert sample([a, c], last) is replaced


def test_rows_with_min_tokens_get_their_bans_from_each_steps_output_count():
    last = LastSamplingBatch()
    seq = sequence("m", 0, temperature=0.5, min_tokens=2)
    banned = sample([seq], last)
    assert banned.adjusted_token_ids.tolist() == [EOS]
    seq.token_ids += [8, 9]  # two output tokens: min_tokens reached
    assert sample([seq], last).adjusted_token_ids is None
