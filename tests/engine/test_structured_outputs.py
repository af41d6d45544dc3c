"""Structured outputs in the engine, on a tiny random model (no EOS) at temperature 1 over 200 seeds: every output
satisfies its constraint (a JSON schema, a regex, a choice, a Lark grammar), and its matcher accepted every token;
n = 4, chunked prefill, preemption, async scheduling and prefix-cache hits give the same outputs as the plain run
(each request is seeded). The mask is exact: the tokens left finite in a step's logits are the matcher's."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
import torch
from conftest import CORPUS
from transformers import AutoTokenizer

pytest.importorskip("llguidance", reason="structured outputs need the structured extra")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.factory import load_backend  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{1,3}(\.[a-z]{2})?"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,5}/'


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# name -> (constraint, whether a finished text satisfies it); each is bounded, so its matcher terminates.
CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=""), valid_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "lark": (StructuredOutputsParams(grammar=LARK), lambda text: re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,5}", text)),
}
NAMES = list(CASES)
NUM_SEEDS = 200
MAX_TOKENS = 64
# A shared prefix of a few blocks, then words of each request's own.
PREFIX = " ".join(CORPUS[:4])


def prompt(index: int) -> str:
    return f"{PREFIX} {index} {CORPUS[index % 5][: 3 + index % 11]}"


def params(index: int, **changes) -> SamplingParams:
    constraint = CASES[NAMES[index % len(NAMES)]][0]
    settings = dict(temperature=1.0, seed=index, max_tokens=MAX_TOKENS, structured_outputs=constraint)
    return SamplingParams(**{**settings, **changes})


def generate(llm: LLM, indices: list[int], **changes) -> list[list[list[int]]]:
    """Each request's samples' token ids."""
    outputs = llm.generate([prompt(i) for i in indices], [params(i, **changes) for i in indices], use_tqdm=False)
    return [[list(sample.token_ids) for sample in output.outputs] for output in outputs]


@pytest.fixture(scope="module")
def backend(llama_dir):
    return load_backend(AutoTokenizer.from_pretrained(llama_dir), 384, [])


def check_outputs(backend, llm: LLM, indices: list[int], outputs) -> None:
    """Every sample's tokens are accepted by a fresh matcher; a sample that ended with "stop" is complete and its
    text satisfies the constraint. Most end with "stop" (the constraints are short)."""
    tokenizer = llm.get_tokenizer()
    stopped = total = 0
    for index, output in zip(indices, outputs):
        constraint, satisfied = CASES[NAMES[index % len(NAMES)]]
        grammar = backend.compile(constraint)
        for sample in output.outputs:
            matcher = grammar.matcher()
            assert all(matcher.accept_token(token) for token in sample.token_ids), (index, sample.text)
            total += 1
            if sample.finish_reason == "stop":
                stopped += 1
                assert matcher.is_terminated()
                assert sample.text == tokenizer.decode(sample.token_ids)
                assert satisfied(sample.text), (index, sample.text)
            else:
                assert sample.finish_reason == "length" and len(sample.token_ids) == MAX_TOKENS
    assert stopped >= 0.9 * total, f"only {stopped} of {total} outputs completed their grammar"


@pytest.fixture(scope="module")
def plain(llama_dir, backend):
    """200 seeded requests, 50 per constraint, in one call; and their tokens."""
    llm = LLM(llama_dir, max_model_len=256)
    indices = list(range(NUM_SEEDS))
    outputs = llm.generate([prompt(i) for i in indices], [params(i) for i in indices], use_tqdm=False)
    check_outputs(backend, llm, indices, outputs)
    assert len({tuple(output.outputs[0].token_ids) for output in outputs}) > NUM_SEEDS // 2  # they do sample
    return [[list(sample.token_ids) for sample in output.outputs] for output in outputs]


def test_every_output_satisfies_its_constraint_and_prefix_hits_change_nothing(llama_dir, plain, backend):
    llm = LLM(llama_dir, max_model_len=256)
    indices = list(range(0, NUM_SEEDS, 5))
    assert generate(llm, indices) == [plain[i] for i in indices]
    again = llm.generate([prompt(i) for i in indices], [params(i) for i in indices], use_tqdm=False)
    assert all(output.num_cached_tokens >= 32 for output in again)  # the shared prefix's blocks were hits
    assert [[list(s.token_ids) for s in output.outputs] for output in again] == [plain[i] for i in indices]


@pytest.mark.parametrize(
    "settings",
    [
        dict(async_scheduling=True),
        dict(max_num_batched_tokens=7),
        dict(async_scheduling=True, max_num_batched_tokens=7),
    ],
    ids=["async", "chunked-7", "async-chunked-7"],
)
def test_async_scheduling_and_chunked_prefill_give_the_same_outputs(llama_dir, plain, settings):
    llm = LLM(llama_dir, max_model_len=256, **settings)
    indices = list(range(1, NUM_SEEDS, 17))
    assert generate(llm, indices) == [plain[i] for i in indices]


def test_constrained_steps_overlap_under_async_scheduling(llama_dir, plain):
    """Async scheduling keeps overlapping steps whose rows a grammar constrains: such a step is queued while the
    one before it is in flight (its constrained rows' input tokens are placeholders then), and its masks are asked
    for only after that, once the step in flight is read back. The outputs are the synchronous run's."""
    llm = LLM(llama_dir, max_model_len=256, async_scheduling=True)
    worker, execute = llm.llm_engine.worker, llm.llm_engine.worker.execute
    overlapped = []  # per constrained plan: queued with its constrained rows' tokens still on the device

    def recording(plan, previous=None, masks=None):
        if masks is None:
            return execute(plan, previous)
        pending = set(plan.placeholder_rows.tolist())
        rows = plan.sample_rows[plan.bitmask_rows].tolist()
        overlapped.append(previous is not None and all(row in pending for row in rows))
        return execute(plan, previous, masks)

    worker.execute = recording
    indices = list(range(2, NUM_SEEDS, 13))
    assert generate(llm, indices) == [plain[i] for i in indices]
    assert sum(overlapped) >= 0.8 * len(overlapped) > 0, overlapped


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborting_a_constrained_request_mid_run_leaves_the_others_as_alone(llama_dir, plain, async_scheduling):
    """Constrained requests decode side by side (overlapped under async scheduling, where the one aborted may be in
    a step in flight and in the next step's masks); one is aborted after a few steps and another arrives then: the
    others' tokens are those of the run without them, and every block is free at the end."""
    llm = LLM(llama_dir, max_model_len=256, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    kept, aborted, late = [0, 4, 8], 1, 2  # JSON requests, a regex one aborted, a choice one arriving late
    for index in [*kept, aborted]:
        engine.add_request(str(index), prompt(index), params(index))
    finished = {}
    for step in range(40):
        if step == 3:
            engine.abort_request(str(aborted))
            engine.add_request(str(late), prompt(late), params(late))
        finished |= {out.request_id: [list(s.token_ids) for s in out.outputs] for out in engine.step() if out.finished}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: [list(s.token_ids) for s in out.outputs] for out in engine.step() if out.finished}
    assert str(aborted) not in finished
    assert {index: finished[str(index)] for index in [*kept, late]} == {index: plain[index] for index in [*kept, late]}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_sequences_keep_their_matchers(llama_dir, plain, async_scheduling):
    """A cache that holds the prompts but not their outputs: sequences are preempted and recomputed. Without prefix
    caching, which would let the prompts share their common start and leave room for the outputs."""
    indices = list(range(0, 32, 4))  # JSON, the longest outputs: each grows past its prompt's blocks
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    num_blocks = sum(-(-len(tokenizer.encode(prompt(i))) // 16) for i in indices)
    llm = LLM(
        llama_dir,
        max_model_len=256,
        num_kv_blocks=num_blocks,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
    )
    assert generate(llm, indices) == [plain[i] for i in indices]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.block_manager.num_free_blocks == num_blocks


def test_n_samples_each_follow_the_grammar_as_requests_seeded_seed_plus_i(llama_dir, plain, backend):
    """Sample i of n = 4 equals the request seeded seed + i: each sample owns its matcher from the fork on."""
    llm = LLM(llama_dir, max_model_len=256, async_scheduling=True)
    indices = [0, 1, 2, 3, 8, 9, 10, 11]  # every constraint
    outputs = llm.generate([prompt(i) for i in indices], [params(i, n=4) for i in indices], use_tqdm=False)
    check_outputs(backend, llm, indices, outputs)
    alone = [replace(params(index), seed=index + sample) for index in indices for sample in range(4)]
    expected = llm.generate([prompt(index) for index in indices for _ in range(4)], alone, use_tqdm=False)
    got = [list(sample.token_ids) for output in outputs for sample in output.outputs]
    assert got == [list(output.outputs[0].token_ids) for output in expected]


def test_the_mask_leaves_finite_exactly_the_tokens_the_matcher_allows(llama_dir, backend, monkeypatch):
    """Every step's logits, after the sampler: a constrained row's finite tokens are the ones its matcher allowed
    at that point (replayed from a fresh matcher); an unconstrained row in the same batch is untouched."""
    import pagedllm.sampling.sampler as sampler_module

    steps = []  # (logits after the sampler, the masked rows) of each step that had a mask
    sample_tokens = sampler_module.sample_tokens

    def recording(logits, params, penalty_state, kernels, mask, generator_states=None):
        output = sample_tokens(logits, params, penalty_state, kernels, mask, generator_states)
        if mask is not None:
            steps.append((logits.clone(), mask.rows.tolist()))  # float32 logits are masked in place
        return output

    monkeypatch.setattr(sampler_module, "sample_tokens", recording)
    llm = LLM(llama_dir, max_model_len=256)
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=CASES["json"][0])
    free = SamplingParams(temperature=1.0, seed=4, max_tokens=2 * MAX_TOKENS)  # runs beside it to its end
    outputs = llm.generate([prompt(0), prompt(1)], [constrained, free], use_tqdm=False)
    tokens = outputs[0].outputs[0].token_ids
    assert len(tokens) >= 10 and len(steps) == len(tokens)  # one masked row per token, until the grammar ended
    matcher = backend.compile(CASES["json"][0]).matcher()
    row = np.zeros(backend.bitmask_words, dtype=np.int32)
    for (logits, rows), token in zip(steps, tokens):
        assert len(rows) == 1 and len(logits) == 2  # the unconstrained request runs beside it
        matcher.fill_bitmask(row)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:384].astype(bool)
        assert torch.equal(torch.isfinite(logits[rows[0]]), torch.from_numpy(allowed))
        assert 0 < allowed.sum() < 384
        assert torch.isfinite(logits[1 - rows[0]]).all()
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and outputs[0].outputs[0].finish_reason == "stop"


def test_logprobs_are_the_models_before_the_mask(llama_dir):
    """A constrained row's logprobs are the raw log-softmax of the model's logits, as every row's are (before
    logit_bias and penalties too): the same as the unconstrained request's, tokens the grammar forbids included."""
    llm = LLM(llama_dir, max_model_len=256)
    constrained = params(2, logprobs=384, max_tokens=1)  # a choice: most of the vocabulary is forbidden
    free = replace(constrained, structured_outputs=None)
    first, unconstrained = (llm.generate(prompt(2), p, use_tqdm=False)[0].outputs[0] for p in (constrained, free))
    assert len(first.logprobs[0]) == 384
    logprobs = {token: entry.logprob for token, entry in first.logprobs[0].items()}
    assert logprobs == {token: entry.logprob for token, entry in unconstrained.logprobs[0].items()}
    assert all(value > float("-inf") for value in logprobs.values())


def large_schema(num_fields: int) -> dict:
    """Compiles in about a second for 8000 fields."""
    pattern = "[a-z]{{{}}}[0-9]+x{}"
    properties = {f"field_{i}": {"type": "string", "pattern": pattern.format(i % 7 + 1, i)} for i in range(num_fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_a_large_schema_compiles_while_the_others_decode(llama_dir):
    """Four unconstrained streams, the time between their steps (add_request's included) with and without a large
    schema compiling meanwhile: the compile runs on the compiler's thread, so no step waits for it."""
    llm = LLM(llama_dir, max_model_len=512)
    engine = llm.llm_engine
    free = SamplingParams(temperature=0, max_tokens=400)

    def step_gaps(compile_large: bool) -> tuple[list[float], float]:
        """The gaps between steps while the large schema compiles (or as many without it), and the compile's time."""
        for index in range(4):
            engine.add_request(f"free-{compile_large}-{index}", prompt(index), free)
        for _ in range(3):  # past the prompts
            engine.step()
        gaps, started = [], time.perf_counter()
        last = started
        if compile_large:
            constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json=large_schema(8000)))
            engine.add_request("large", prompt(0), constrained)
        while (engine.waits_for_grammar("large") if compile_large else len(gaps) < 100) and len(gaps) < 2000:
            engine.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        compile_time = time.perf_counter() - started
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        return gaps, compile_time

    step_gaps(False)  # warm
    without, _ = step_gaps(False)
    during, compile_time = step_gaps(True)
    assert compile_time > 0.3 and len(during) > 10  # long enough that a step waiting for it would show
    p99_without, p99_during = np.percentile(without, 99), np.percentile(during, 99)
    assert p99_during < 4 * p99_without + 0.05, (p99_during, p99_without, compile_time)
    assert max(during) < compile_time / 2


def test_a_grammar_the_library_gives_up_on_ends_as_abort(llama_dir):
    """500 optional objects of enums: llguidance's parser exceeds its limits on the first token, which its mask
    allowed. That output ends there, as "abort"; the request beside it is served as before."""
    properties = {
        f"field_{i}": {"type": "object", "properties": {"kind": {"enum": [f"kind_{i}_{j}" for j in range(10)]}}}
        for i in range(500)
    }
    too_complex = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": properties})
    )
    free = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(llama_dir, max_model_len=256)
    alone = llm.generate(prompt(1), free, use_tqdm=False)[0].outputs[0]
    refused, beside = (
        output.outputs[0] for output in llm.generate([prompt(0), prompt(1)], [too_complex, free], use_tqdm=False)
    )
    assert refused.finish_reason == "abort" and len(refused.token_ids) == 1
    assert beside.token_ids == alone.token_ids and beside.finish_reason == "length"


def test_without_llguidance_a_structured_request_names_the_extra(llama_dir, monkeypatch):
    """The backend loads at the first structured request: that request fails, later ones at once, and the engine
    serves the others."""
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    monkeypatch.delitem(sys.modules, "pagedllm.structured_output.llguidance_backend", raising=False)
    llm = LLM(llama_dir, max_model_len=256)
    free = SamplingParams(temperature=0, max_tokens=4)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"prompts\[1\]: .*pip install 'pagedllm\[structured\]'"):
            llm.generate([prompt(0), prompt(1)], [free, params(1)], use_tqdm=False)
        assert llm.generate(prompt(0), free, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_a_stop_string_ends_a_constrained_output_as_usual(llama_dir):
    llm = LLM(llama_dir, max_model_len=256)
    regex = StructuredOutputsParams(regex=REGEX)
    output = llm.generate(prompt(0), SamplingParams(seed=0, stop=["-"], structured_outputs=regex), use_tqdm=False)
    completion = output[0].outputs[0]
    assert completion.text in ("cat", "dog") and completion.finish_reason == "stop" and completion.stop_reason == "-"
