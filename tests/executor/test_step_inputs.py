"""Step inputs packed into one host buffer and copied at once: every field reads back as the plan's array, whatever
the step before it held, and the decode pack's device memory never moves (CUDA graphs read it)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.executor.cuda_graphs import graph_token_counts, padded_batch_size
from pagedllm.executor.plan_fields import plan_arrays
from pagedllm.executor.step_inputs import PackedInputs, StepBuffers, pad_decode_plan, pad_prefill_plan
from pagedllm.executor.step_plan import StepPlan
from pagedllm.structured_output.backend import bitmask_words

CPU = torch.device("cpu")
WIDTH = 6
WIDTHS = {"bitmask_words": 2}  # a grammar's mask rows: a 64-token vocabulary


def engine_widths(worker) -> dict[str, int]:
    """As the worker builds its buffers on CUDA."""
    return {"bitmask_words": bitmask_words(worker.spec.vocab_size)}


def make_plan(query_lens: list[int], seed: int, width: int = WIDTH) -> StepPlan:
    rng = np.random.default_rng(seed)
    num_seqs, num_tokens = len(query_lens), sum(query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = (np.array(query_lens) + rng.integers(0, 20, num_seqs)).astype(np.int32)
    pending = np.flatnonzero(np.array(query_lens) == 1)
    return StepPlan(
        step_id=seed,
        input_ids=rng.integers(0, 1000, num_tokens),
        positions=rng.integers(0, 100, num_tokens),
        slot_mapping=rng.integers(0, 500, num_tokens),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=rng.integers(0, 50, (num_seqs, width)).astype(np.int32),
        sample_rows=query_start_loc[1:].astype(np.int64) - 1,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        decode_only=max(query_lens) == 1,
        placeholder_rows=query_start_loc[pending].astype(np.int64),
        placeholder_sources=rng.integers(0, 8, len(pending)),
        sampling=None,
    )


def assert_inputs_match(inputs, plan: StepPlan) -> None:
    """Every uploaded array (by its name on the inputs) and what attention reads equal the plan's arrays."""
    metadata = inputs.metadata
    uploaded = [name for name, spec in plan_arrays(type(plan)) if spec.upload]
    assert set(uploaded) == set(inputs.arrays)
    assert {"input_ids", "positions", "sample_rows", "placeholder_rows", "placeholder_sources"}.issubset(uploaded)
    for tensor, array in [
        *((getattr(inputs, name), getattr(plan, name)) for name in uploaded),
        (metadata.slot_mapping, plan.slot_mapping),
        (metadata.query_start_loc, plan.query_start_loc),
        (metadata.seq_lens, plan.seq_lens),
        (metadata.block_tables, plan.block_tables),
    ]:
        if array.ndim == 2:  # block tables: the buffer's rows may be wider than the plan's
            assert tensor.shape[1] >= array.shape[1]
            tensor = tensor[:, : array.shape[1]]
        assert tensor.shape == array.shape
        assert tensor.tolist() == array.tolist()
    assert (metadata.max_query_len, metadata.max_seq_len) == (plan.max_query_len, plan.max_seq_len)
    assert metadata.decode_only == plan.decode_only


def test_each_field_reads_back_after_larger_and_smaller_steps():
    pack = PackedInputs(max_tokens=64, max_seqs=8, table_width=WIDTH, device=CPU, widths=WIDTHS)
    plans = [make_plan([5, 1, 30, 1, 7, 1, 2, 1], 0), make_plan([1, 1, 1], 1, width=2), make_plan([9, 1], 2)]
    for plan in plans:
        assert_inputs_match(pack.upload(plan), plan)


def test_a_full_pack_fills_every_field_to_its_end():
    pack = PackedInputs(max_tokens=8, max_seqs=8, table_width=WIDTH, device=CPU, widths=WIDTHS)
    plan = make_plan([1] * 8, 3)
    assert_inputs_match(pack.upload(plan), plan)


def test_decode_steps_use_the_decode_pack_at_fixed_addresses():
    buffers = StepBuffers(max_tokens=64, max_seqs=8, table_width=WIDTH, device=CPU, widths=WIDTHS)
    addresses = {name: view.data_ptr() for name, view in buffers.decode.device.items()}
    decode, prefill = make_plan([1] * 5, 4), make_plan([20, 3], 5)
    decode = pad_decode_plan(decode, 8)  # as the worker pads a decode step to a graph's batch size
    inputs = buffers.upload(decode)
    assert_inputs_match(inputs, decode)
    assert inputs.input_ids.data_ptr() == addresses["input_ids"]
    assert inputs.metadata.block_tables.data_ptr() == addresses["block_tables"]
    assert_inputs_match(buffers.upload(prefill), prefill)  # the other pack: the decode pack keeps its values
    assert buffers.decode.device["input_ids"][:8].tolist() == decode.input_ids.tolist()
    assert {name: view.data_ptr() for name, view in buffers.decode.device.items()} == addresses


def test_an_engine_on_packed_inputs_generates_what_it_does_without_them(llama_dir):
    """The CUDA path's inputs on CPU: plans packed and copied, decode steps padded to graph batch sizes, block tables
    narrower than the buffer's rows (their columns past each row hold earlier steps' block ids, which attention must
    never read). Requests of different lengths end at different steps, chunked and with async scheduling."""
    from pagedllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 2 for j in range(9 + 23 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 7 * i, ignore_eos=True) for i in range(6)]
    settings = dict(max_model_len=256, max_num_batched_tokens=64, async_scheduling=True)

    def tokens(llm) -> list[list[int]]:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]

    expected = tokens(LLM(llama_dir, **settings))
    packed = LLM(llama_dir, **settings)
    worker = packed.llm_engine.worker
    worker.buffers = StepBuffers(
        64, worker.config.max_num_seqs, table_width=256 // 16, device=CPU, widths=engine_widths(worker)
    )
    uploads = []
    upload = worker.buffers.upload
    worker.buffers.upload = lambda plan: uploads.append(plan.block_tables.shape[1]) or upload(plan)
    assert tokens(packed) == expected
    assert len(set(uploads)) > 2  # tables of several widths went through the same buffer


def test_prefill_padding_adds_empty_sequences_and_tokens_that_store_nothing():
    original = make_plan([5, 1, 30], 6)
    before = {name: getattr(original, name).copy() for name, _ in plan_arrays(StepPlan)}
    plan = pad_prefill_plan(original, num_tokens=64, num_seqs=8)
    for name, array in before.items():  # a new plan: the one padded is left as it was
        assert np.array_equal(getattr(original, name), array), name
    assert plan.num_tokens == 64 and plan.num_seqs == 8
    assert plan.input_ids[:36].tolist() == before["input_ids"].tolist()
    assert plan.slot_mapping[:36].tolist() == before["slot_mapping"].tolist()
    assert (plan.slot_mapping[36:] == -1).all()
    assert plan.query_start_loc.tolist() == before["query_start_loc"].tolist() + [36] * 5
    assert (plan.seq_lens[3:] == 0).all()
    assert plan.block_tables.shape[0] == 3  # an empty sequence's row is never read: not written
    assert plan.sample_rows.tolist() == [4, 5, 35]


def test_graph_token_counts_cover_every_step_size():
    counts = graph_token_counts(8192)
    assert counts == sorted(set(counts)) and counts[-1] == 8192
    assert all(count % 16 == 0 for count in counts)
    for num_tokens in range(1, 8193):
        padded = padded_batch_size(counts, num_tokens)
        assert num_tokens <= padded <= max(16, 2 * num_tokens, num_tokens + 1023)
    assert graph_token_counts(40) == [16, 32, 40]
    assert graph_token_counts(32768)[-1] == 8192  # larger steps run eagerly


def test_an_engine_with_padded_prefill_steps_generates_what_it_does_without_them(llama_dir):
    """The CUDA path of prompt steps on CPU: each padded to a prefill graph's token count and to max_num_seqs
    sequences (empty ones), or above the largest count left as it is, read through the packs. Prompt logprobs,
    chunks beside decodes, async scheduling."""
    from pagedllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 2 for j in range(5 + 19 * i)]} for i in range(5)]
    params = [
        SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
        for i in range(5)
    ]
    settings = dict(max_model_len=256, max_num_batched_tokens=40, max_num_seqs=8, async_scheduling=True)

    def outputs(llm) -> list:
        results = llm.generate(prompts, params, use_tqdm=False)
        return [(result.outputs[0].token_ids, result.prompt_logprobs) for result in results]

    expected = outputs(LLM(llama_dir, **settings))
    padded = LLM(llama_dir, **settings)
    worker = padded.llm_engine.worker
    worker.buffers = StepBuffers(
        40, worker.config.max_num_seqs, table_width=256 // 16, device=CPU, widths=engine_widths(worker)
    )
    worker.pads_steps = True
    worker.prefill_token_counts = [16, 32]  # steps of 33-40 tokens run as they are, as steps above 8192 do on CUDA
    sizes = []
    pad = worker.pad_to_graph
    worker.pad_to_graph = lambda plan: sizes.append((plan.num_tokens, plan.decode_only)) or pad(plan)
    got = outputs(padded)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        assert (ours is None) == (theirs is None)
        for position_ours, position_theirs in zip(ours or [], theirs or []):
            assert (position_ours is None) == (position_theirs is None)
            for token, logprob in (position_theirs or {}).items():
                assert abs(position_ours[token].logprob - logprob.logprob) < 1e-4
    prompt_steps = [num_tokens for num_tokens, decode_only in sizes if not decode_only]
    assert any(num_tokens not in (16, 32) and num_tokens <= 32 for num_tokens in prompt_steps)  # padded
    assert any(num_tokens > 32 for num_tokens in prompt_steps)  # not padded
