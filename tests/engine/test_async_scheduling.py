"""Async scheduling changes no output: random programs of arrivals, steps and aborts, with requests that end on EOS,
on a stop token or at max_tokens at different steps, give every request the tokens it gets alone and synchronously.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
from conftest import VOCAB_SIZE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams

NUM_PROMPTS = 12
rng = random.Random(3)
PROMPTS = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(1, 40))] for _ in range(NUM_PROMPTS)]
MAX_TOKENS = 12


def request_params(prompt_index: int, ending: str, reference: list[int]) -> SamplingParams:
    """ending: 'eos' (the engine's EOS token), 'stop' (a stop token the request reaches at a step of its own),
    or 'length' (ignore_eos, so only max_tokens ends it)."""
    if ending == "stop":
        stop_token = reference[(prompt_index * 5) % len(reference)]
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token])
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=ending == "length")


def set_eos(llm: LLM, eos_token: int) -> None:
    llm.llm_engine.eos_token_ids = frozenset({eos_token})


@pytest.fixture(scope="module")
def setup(llama_dir):
    """The references: each (prompt, ending) run alone on a synchronous engine. EOS is the token the model
    produces in the most requests, so that many end on it, each at its own step."""
    sync = LLM(llama_dir, async_scheduling=False)
    no_eos = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free_runs = [
        output.outputs[0].token_ids
        for output in sync.generate([{"prompt_token_ids": p} for p in PROMPTS], no_eos, use_tqdm=False)
    ]
    eos_token = Counter(token for run in free_runs for token in set(run[1:])).most_common(1)[0][0]
    set_eos(sync, eos_token)
    references = {}
    for index, prompt in enumerate(PROMPTS):
        for ending in ("eos", "stop", "length"):
            params = request_params(index, ending, free_runs[index])
            output = sync.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
            references[index, ending] = (params, output.token_ids, output.finish_reason)
    eos_ends = [key for key, value in references.items() if key[1] == "eos" and value[2] == "stop"]
    assert len(eos_ends) >= 4, "the test needs requests that really end on EOS"
    engines = {
        "default": LLM(llama_dir, async_scheduling=True),
        "chunked": LLM(llama_dir, async_scheduling=True, max_num_batched_tokens=7),
        "preempting": LLM(llama_dir, async_scheduling=True, num_kv_blocks=5, block_size=16),
    }
    for llm in engines.values():
        set_eos(llm, eos_token)
    return sync, references, engines


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, NUM_PROMPTS - 1), st.sampled_from(["eos", "stop", "length"])),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@pytest.mark.parametrize("engine_name", ["default", "chunked", "preempting"])
def test_async_scheduling_changes_no_output(setup, engine_name):
    sync, references, engines = setup
    llm = engines[engine_name]
    engine = llm.llm_engine
    preemptions_before = engine.scheduler.num_preemptions

    examples = int(os.environ.get("ASYNC_EXAMPLES", 60))  # raise it to search harder

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(operations=st.lists(operation, min_size=1, max_size=40))
    def run(operations):
        added: list[tuple[str, tuple[int, str]]] = []
        aborted: set[str] = set()
        finished = {}

        def collect(outputs):
            for output in outputs:
                if output.finished:
                    finished[output.request_id] = output

        for op in operations:
            if op[0] == "add":
                request_id = f"r{len(added)}"
                params = references[op[1], op[2]][0]
                engine.add_request(request_id, {"prompt_token_ids": PROMPTS[op[1]]}, params, stream=False)
                added.append((request_id, (op[1], op[2])))
            elif op[0] == "step":
                for _ in range(op[1]):
                    collect(engine.step())
            elif added:
                request_id = added[op[1] % len(added)][0]
                if request_id not in finished:
                    engine.abort_request(request_id)
                    aborted.add(request_id)
        while engine.has_unfinished_requests():
            collect(engine.step())
        for request_id, key in added:
            if request_id in aborted:  # aborted before it finished: it never reports afterwards
                assert request_id not in finished
                continue
            _, tokens, reason = references[key]
            output = finished[request_id].outputs[0]
            assert (output.token_ids, output.finish_reason) == (tokens, reason), f"{request_id} {key}"
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    run()
    if engine_name == "preempting":  # random programs may not preempt: this one must (5 x 2 blocks > 5 blocks)
        batch = [{"prompt_token_ids": [2 + index] * 14} for index in range(5)]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [sync.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids for prompt in batch]
        assert [output.outputs[0].token_ids for output in llm.generate(batch, params, use_tqdm=False)] == expected
        assert engine.scheduler.num_preemptions > preemptions_before


def test_aborting_every_request_in_flight_leaves_nothing_unfinished(setup):
    """generate() cleans up a failed run by aborting its requests; with a step in flight, the engine must then
    report nothing unfinished at once, not one step later."""
    engine = setup[2]["default"].llm_engine
    for index in range(3):
        engine.add_request(f"x{index}", {"prompt_token_ids": PROMPTS[index]}, SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    assert engine.pipeline.in_flight is not None
    for index in range(3):
        engine.abort_request(f"x{index}")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_requests_ending_at_the_model_length_match_sync(llama_dir):
    """max_tokens=None ends each request at max_model_len, a step that depends on its prompt's length; beside them,
    requests ending at max_tokens and on stop tokens. Async scheduling gives each the same tokens and finish
    reason as the synchronous engine, and holds no block afterwards."""
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS[:6]]
    params = [
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, stop_token_ids=[PROMPTS[4][0]]),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
    ]
    results = {}
    for overlap in (False, True):
        llm = LLM(llama_dir, async_scheduling=overlap, max_model_len=48)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [(output.outputs[0].token_ids, output.outputs[0].finish_reason) for output in outputs]
        manager = llm.llm_engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
    assert results[True] == results[False]
    first_five, reason = results[True][1]
    assert reason == "length" and len(first_five) == 5  # max_tokens ends request 1
    at_model_length = [
        len(prompt["prompt_token_ids"]) + len(token_ids)
        for row, (prompt, (token_ids, reason)) in enumerate(zip(prompts, results[True]))
        if reason == "length" and row != 1
    ]
    assert len(at_model_length) >= 4 and set(at_model_length) == {48}
