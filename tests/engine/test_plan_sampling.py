"""A plan's sampling batch is built again only when it can differ from the previous plan's: the same sequences in
the same order reuse it; another sequence, another order, or a row with min_tokens (whose bans follow its output
count) get a fresh one with their own settings. In the engine, requests with other settings arriving mid-run get
the tokens they get alone, async scheduling on and off."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.plan_builder import LastSamplingBatch, step_sampling
from pagedllm.scheduler.scheduler import ScheduledBatch
from pagedllm.scheduler.sequence import Sequence

EOS = 2


def sequence(name: str, state_index: int, **params) -> Sequence:
    seq = Sequence(name, [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    seq.state_index = state_index
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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_arrivals_with_other_settings_mid_run_get_their_own_tokens(llama_dir, async_scheduling):
    llm = LLM(llama_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    arrivals = [  # (steps run before it arrives, prompt, settings)
        (0, "The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        (3, "A glass of", SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)),
        (2, "Once upon a time", SamplingParams(temperature=0.8, seed=5, min_tokens=4, max_tokens=8)),
        (1, "def f(x):", SamplingParams(temperature=0.5, seed=7, top_k=5, max_tokens=9, ignore_eos=True)),
    ]
    alone = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids for _, prompt, params in arrivals]
    engine = llm.llm_engine
    tokens = {}
    for index, (steps, prompt, params) in enumerate(arrivals):
        for _ in range(steps):
            tokens.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.add_request(str(index), prompt, params, stream=False)
    while engine.has_unfinished_requests():
        tokens.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [tokens[str(index)] for index in range(len(arrivals))] == alone
