"""n > 1: a request's samples share its prompt's KV blocks (computed once, prefix caching on or off), fork on their
first token, and sample i gives what a request with seed + i gives alone; every block comes back."""

from __future__ import annotations

import random

import pytest
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams

rng = random.Random(11)
PROMPT_37 = [rng.randrange(2, VOCAB_SIZE) for _ in range(37)]  # two full blocks and a shared, partly filled third
PROMPT_32 = PROMPT_37[:32]  # two full blocks: the samples' first tokens start blocks of their own
N = 4
PARAMS = SamplingParams(n=N, temperature=1.0, top_k=40, seed=100, max_tokens=12, ignore_eos=True)


def per_sample(params: SamplingParams, index: int) -> SamplingParams:
    """The documented rule: sample i draws like a request of its own with seed + i."""
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=params.seed + index,
                          max_tokens=params.max_tokens, ignore_eos=True)  # fmt: skip


def separate_requests(llm: LLM, prompt: list[int]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": prompt}] * N
    outputs = llm.generate(prompts, [per_sample(PARAMS, index) for index in range(N)], use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def record_copies(llm: LLM) -> list[int]:
    """The number of KV blocks each step copied (copy-on-write of a shared block)."""
    worker, copies = llm.llm_engine.worker, []
    execute = worker.execute

    def recording(plan, previous=None, masks=None):
        copies.append(len(plan.block_copies))
        return execute(plan, previous, masks)

    worker.execute = recording
    return copies


def assert_no_block_held(llm: LLM) -> None:
    block_manager = llm.llm_engine.block_manager
    block_manager.check_invariants(holders=[])
    assert block_manager.num_free_blocks == block_manager.num_blocks and not llm.llm_engine.requests


@pytest.fixture(scope="module")
def expected(llama_dir) -> dict[int, list[list[int]]]:
    llm = LLM(llama_dir, num_kv_blocks=64, enable_prefix_caching=False)
    return {len(prompt): separate_requests(llm, prompt) for prompt in (PROMPT_37, PROMPT_32)}


@pytest.mark.parametrize("prompt", [PROMPT_37, PROMPT_32], ids=["partial-block", "full-blocks"])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_samples_equal_seeded_requests_and_compute_the_prompt_once(
    llama_dir, expected, prompt, prefix_caching, async_scheduling
):
    llm = LLM(llama_dir, num_kv_blocks=64, enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    prefill_tokens = []
    llm.llm_engine.add_step_listener(lambda record: prefill_tokens.append(record.num_prefill_tokens))
    copies = record_copies(llm)
    output = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]
    assert [completion.index for completion in output.outputs] == list(range(N))
    assert [completion.token_ids for completion in output.outputs] == expected[len(prompt)]
    assert all(completion.finish_reason == "length" for completion in output.outputs)
    assert sum(prefill_tokens) == len(prompt)  # the prompt is computed once, not once per sample
    # The shared partly filled block is copied for all samples but the last to write into it.
    assert sum(copies) == (N - 1 if len(prompt) % 16 else 0)
    assert_no_block_held(llm)


def test_samples_share_the_prompt_blocks_by_reference_count(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=32, enable_prefix_caching=False, async_scheduling=False)
    engine = llm.llm_engine
    engine.add_request("n", {"prompt_token_ids": PROMPT_37}, PARAMS)
    outputs = engine.step()  # the prompt, and every sample's first token
    assert [len(completion.token_ids) for completion in outputs[0].outputs] == [1] * N
    samples = [seq for seq in engine.scheduler.running if seq.request_id == "n"]
    assert len(samples) == N and len({tuple(seq.block_table) for seq in samples}) == 1
    blocks = [engine.block_manager.blocks[block_id] for block_id in samples[0].block_table]
    assert [block.ref_count for block in blocks] == [N] * 3
    assert engine.block_manager.num_free_blocks == 32 - 3
    engine.step()  # each sample writes its first token: three private copies of the third block
    engine.block_manager.check_invariants(holders=engine.scheduler.running)
    assert [engine.block_manager.blocks[block_id].ref_count for block_id in samples[0].block_table[:2]] == [N] * 2
    assert len({seq.block_table[2] for seq in samples}) == N
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_block_held(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streaming_reports_every_sample(llama_dir, async_scheduling):
    llm = LLM(llama_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    engine.add_request("n", {"prompt_token_ids": PROMPT_37}, PARAMS, stream=True)
    counts = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert len(output.outputs) == N
            counts.append([len(completion.token_ids) for completion in output.outputs])
    assert counts == [[step] * N for step in range(1, PARAMS.max_tokens + 1)]
    assert_no_block_held(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_samples_survive_preemption(llama_dir, expected, async_scheduling):
    """Five blocks hold the shared prompt but not the four samples' private copies of its last block: samples are
    recomputed (on their own, from the prompt and their tokens), and still give their seeded tokens."""
    llm = LLM(llama_dir, num_kv_blocks=5, async_scheduling=async_scheduling)
    output = llm.generate({"prompt_token_ids": PROMPT_37}, PARAMS, use_tqdm=False)[0]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [completion.token_ids for completion in output.outputs] == expected[37]
    assert_no_block_held(llm)


def test_aborting_a_request_ends_every_sample(llama_dir):
    """Slots are taken for all n samples at admission; an abort before the fork (while the prompt is prefilled in
    chunks) and one after it give them all back, and every block."""
    llm = LLM(llama_dir, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=N + 1)
    engine = llm.llm_engine
    engine.add_request("before-fork", {"prompt_token_ids": PROMPT_37}, PARAMS)
    engine.add_request("single", {"prompt_token_ids": PROMPT_32}, SamplingParams(max_tokens=40))
    # The first 16-token chunk of the n = 4 request: its four state indices are taken, the forks hold no block.
    engine.step()
    assert len(engine.scheduler.free_state_indices) == 1
    engine.abort_request("before-fork")
    assert len(engine.scheduler.free_state_indices) == N + 1
    engine.add_request("after-fork", {"prompt_token_ids": PROMPT_32}, PARAMS)
    for _ in range(8):
        engine.step()
    running = [seq.request_id for seq in engine.scheduler.running]
    assert sorted(running) == ["after-fork"] * N + ["single"] and not engine.scheduler.free_state_indices
    engine.abort_request("after-fork")
    assert len(engine.scheduler.free_state_indices) == N
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_block_held(llm)
    assert sorted(engine.scheduler.free_state_indices) == list(range(N + 1))


def test_copy_on_write_copies_fp8_scales_too(llama_dir):
    """With an fp8 cache the copied block's per-token scales must come along: n samples still equal n requests."""
    llm = LLM(llama_dir, num_kv_blocks=64, enable_prefix_caching=False, kv_cache_dtype="fp8")
    copies = record_copies(llm)
    output = llm.generate({"prompt_token_ids": PROMPT_37}, PARAMS, use_tqdm=False)[0]
    assert sum(copies) == N - 1
    assert [completion.token_ids for completion in output.outputs] == separate_requests(llm, PROMPT_37)
    assert_no_block_held(llm)
