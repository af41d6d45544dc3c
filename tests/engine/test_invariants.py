"""Greedy output must not change with prefix caching, chunk size, preemption or batch composition
(docs/design.md, "Invariants that are tests"), and no KV block may stay held once every request has ended."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams
from pagedllm.executor import start_up
from pagedllm.executor.plan_fields import check_plan

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_prompts(count: int = 16, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(2, VOCAB_SIZE) for _ in range(40)]
    prompts = []
    for index in range(count):
        tail = [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(1, 60))]
        prompts.append({"prompt_token_ids": (shared_prefix if index % 2 else []) + tail})
    return prompts


def greedy_tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_no_block_held(llm: LLM) -> None:
    block_manager = llm.llm_engine.block_manager
    block_manager.check_invariants(holders=[])
    assert block_manager.num_free_blocks == block_manager.num_blocks


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def baseline(llama_dir, prompts):
    llm = LLM(llama_dir, enable_prefix_caching=False, max_num_batched_tokens=4096)
    tokens = greedy_tokens(llm, prompts)
    assert_no_block_held(llm)
    return tokens


def test_prefix_caching_changes_nothing(llama_dir, prompts, baseline):
    llm = LLM(llama_dir, enable_prefix_caching=True)
    assert greedy_tokens(llm, prompts) == baseline
    assert greedy_tokens(llm, prompts) == baseline  # second pass: served mostly from the cache
    assert_no_block_held(llm)


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prefill_changes_nothing(llama_dir, prompts, baseline, budget):
    llm = LLM(llama_dir, max_num_batched_tokens=budget)
    assert greedy_tokens(llm, prompts) == baseline
    assert_no_block_held(llm)


def test_preemption_changes_nothing(llama_dir, prompts, baseline):
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + GREEDY.max_tokens
    llm = LLM(llama_dir, num_kv_blocks=-(-longest // 16), block_size=16)
    assert greedy_tokens(llm, prompts) == baseline
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_no_block_held(llm)


def test_start_up_steps_on_the_real_cache_change_nothing(llama_dir, prompts, baseline):
    """On CUDA, start-up runs its largest steps again over the real cache's first blocks (start_up.refill_allocator) and
    leaves their K/V there, in the first blocks that requests get; blocks also keep ended requests' K/V. A request
    writes each position before it reads it, so neither changes outputs: here every block starts as large garbage."""
    llm = LLM(llama_dir, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=16, num_kv_blocks=200)
    worker = llm.llm_engine.worker
    for tensor in (worker.kv_cache.keys, worker.kv_cache.values):
        tensor.normal_(std=100.0)
    garbage = worker.kv_cache.keys.clone()
    start_up.refill_allocator(worker)
    plans, num_written = start_up.start_up_steps(worker)
    for plan in plans:
        check_plan(plan)
    assert not torch.equal(worker.kv_cache.keys[:, :num_written], garbage[:, :num_written])  # the steps ran there
    assert greedy_tokens(llm, prompts) == baseline
    assert_no_block_held(llm)


def test_batch_composition_changes_nothing(llama_dir, prompts, baseline):
    llm = LLM(llama_dir)
    alone = [greedy_tokens(llm, [prompt])[0] for prompt in prompts[:3]]
    assert alone == baseline[:3]
    assert greedy_tokens(llm, prompts) == baseline


def test_shared_prefix_reports_cached_tokens(llama_dir):
    llm = LLM(llama_dir, block_size=16)
    prefix = list(range(2, 70))
    first = llm.generate({"prompt_token_ids": prefix + [70]}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prefix + [71, 72]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # four full blocks of the 68-token shared prefix


def test_prompts_of_one_batch_compute_their_shared_prefix_once(llama_dir):
    """Requests arriving together: the first computes the shared prefix, the others wait a step and find it cached
    (the scheduler's in-step sharing); their tokens equal those computed without the cache."""
    prompts = [{"prompt_token_ids": list(range(2, 70)) + [70 + index]} for index in range(4)]
    outputs = LLM(llama_dir, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    assert [output.num_cached_tokens for output in outputs] == [0, 64, 64, 64]
    uncached = LLM(llama_dir, block_size=16, enable_prefix_caching=False)
    assert [output.outputs[0].token_ids for output in outputs] == greedy_tokens(uncached, prompts)


def test_an_engine_dropped_without_shutdown_is_freed_by_the_next_start_up(llama_dir):
    """Engines sit in reference cycles, so dropping one frees nothing until a full collection; the next engine's
    start-up runs one before it takes memory (with the collector off here, only that collection can free it)."""
    gc.disable()
    try:
        llm = LLM(llama_dir, num_kv_blocks=64)
        greedy_tokens(llm, make_prompts(2))
        kv_cache = weakref.ref(llm.llm_engine.worker.kv_cache.keys)
        weights = weakref.ref(next(llm.llm_engine.worker.model.parameters()))
        del llm
        assert kv_cache() is not None  # still held by the cycles: the situation the start-up collection is for
        LLM(llama_dir, num_kv_blocks=64)
        assert kv_cache() is None and weights() is None
    finally:
        gc.enable()


def test_abort_frees_every_block(llama_dir, prompts):
    llm = LLM(llama_dir, max_num_batched_tokens=32)
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    for index in range(0, len(prompts), 2):  # abort running and waiting requests alike
        engine.abort_request(f"r{index}")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {output.request_id for output in engine.step() if output.finished}
    assert finished == {f"r{index}" for index in range(1, len(prompts), 2)}
    assert_no_block_held(llm)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(max_num_batched_tokens=7), dict(num_kv_blocks=8), dict(max_num_batched_tokens=64, num_kv_blocks=12)],
)
def test_async_scheduling_changes_nothing(llama_dir, prompts, baseline, kwargs):
    """Overlapped steps (the CUDA default) schedule ahead with placeholder tokens; on CPU they run the same
    logic synchronously, so the tokens, preemptions and block accounting are checked here too."""
    llm = LLM(llama_dir, async_scheduling=True, **kwargs)
    assert greedy_tokens(llm, prompts) == baseline
    if "num_kv_blocks" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_no_block_held(llm)


def test_async_scheduling_stops_and_aborts_in_flight(llama_dir, prompts, baseline):
    """A stop token found one step late must not leak the extra step's token; an abort while a step is in
    flight frees everything."""
    llm = LLM(llama_dir, async_scheduling=True)
    stop_token = baseline[0][3]
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])
    output = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == baseline[0][: baseline[0].index(stop_token) + 1]
    assert output.finish_reason == "stop"
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts[:4]):
        engine.add_request(f"a{index}", prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.pipeline.in_flight is not None
    engine.abort_request("a0")
    engine.abort_request("a3")
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {output.request_id: output for output in engine.step() if output.finished}
    assert set(finished) == {"a1", "a2"}
    assert [finished[f"a{i}"].outputs[0].token_ids for i in (1, 2)] == baseline[1:3]
    assert_no_block_held(llm)
