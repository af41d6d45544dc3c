"""Speculative decoding end to end on the tiny checkpoints: with n-gram drafts and with a draft model, greedy outputs
equal those without speculation, token for token, under chunked prefill, prefix caching, forced preemption, async
scheduling and n = 2, and so do seeded ones with n-gram drafts (one-hot: each row's own draw decides). A draft model
samples a non-greedy request's drafts from its own distribution, and their verify steps take the rejection rule: they
complete, accept as often as the draft's closeness to the target says, and a seeded request repeats its tokens. EOS,
stop tokens, stop strings and max_tokens that land inside a run of accepted drafts end the output exactly there; no KV
block stays held once every request has ended."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import VOCAB_SIZE
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.speculator import BATCH_TOO_LARGE, NOT_PROPOSED, VERIFIED

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Each on another sampler path: the race, top-k/top-p, penalties (which count the drafts before a verify row), n = 2.
SEEDED = [
    SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=6, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, frequency_penalty=0.4, repetition_penalty=1.2, seed=7, max_tokens=16,
                   ignore_eos=True),
    SamplingParams(temperature=0.9, min_p=0.05, seed=8, n=2, max_tokens=16, ignore_eos=True),
]  # fmt: skip


def copy_heavy_prompts(count: int = 8, seed: int = 0) -> list[dict]:
    """Random token segments, each said three times: the n-gram lookup finds matches, and a random model often
    goes on repeating them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        segment = [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(4, 16))]
        prompts.append({"prompt_token_ids": segment * 3})
    return prompts


PROMPTS = copy_heavy_prompts()


def completions(llm: LLM, params, prompts: list[dict] = PROMPTS) -> list[list[tuple]]:
    """Each request's samples as (token ids, finish reason, stop reason, text); no block is held afterwards."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    block_manager = llm.llm_engine.block_manager
    block_manager.check_invariants(holders=[])
    assert block_manager.num_free_blocks == block_manager.num_blocks
    return [[(s.token_ids, s.finish_reason, s.stop_reason, s.text) for s in output.outputs] for output in outputs]


def lengths(outputs: list[list[tuple]]) -> list[list[int]]:
    return [[len(sample[0]) for sample in output] for output in outputs]


class Records:
    """The step records of an engine, from now on."""

    def __init__(self, llm: LLM):
        self.steps = []
        llm.llm_engine.add_step_listener(self.steps.append)

    def total(self, name: str) -> int:
        return sum(getattr(record, name) for record in self.steps)


@pytest.fixture(scope="module")
def baseline(llama_dir) -> LLM:
    return LLM(llama_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def expected(baseline) -> dict[str, list]:
    """The outputs without speculation."""
    return {"greedy": completions(baseline, GREEDY), "seeded": completions(baseline, SEEDED * 2)}


@pytest.fixture(scope="module")
def near_draft_dir(llama_dir, tmp_path_factory) -> str:
    """A draft that often agrees with the target: the target's weights with a little noise, its tokenizer."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    directory = tmp_path_factory.mktemp("near_draft")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(directory)
    return str(directory)


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def speculating(llama_dir, near_draft_dir):
    """proposer name -> its speculative_config."""
    return {"ngram": NGRAM, "draft": draft_config(near_draft_dir)}


ENGINES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempted": dict(num_kv_blocks=10),
    "async": dict(async_scheduling=True),
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_and_seeded_outputs_equal_those_without_speculation(llama_dir, expected, speculating, proposer, engine):
    """Greedy twice (the second pass from the prefix cache), then seeded. A verify row of one-hot drafts samples from
    the request's distribution with the request's own draw, so accepted drafts are the tokens it would have sampled
    anyway. A draft model's drafts for a seeded request are drawn from its distribution and verified by the rejection
    rule: the same distribution, other draws (test_sampled_drafts_complete_and_seeded_runs_repeat)."""
    llm = LLM(llama_dir, speculative_config=speculating[proposer], **ENGINES[engine])
    records = Records(llm)
    assert completions(llm, GREEDY) == expected["greedy"]
    assert completions(llm, GREEDY) == expected["greedy"]
    seeded = completions(llm, SEEDED * 2)
    if proposer == "ngram":
        assert seeded == expected["seeded"]
    else:
        assert lengths(seeded) == lengths(expected["seeded"])
    accepted, proposed = records.total("num_accepted_tokens"), records.total("num_draft_tokens")
    assert 0 < accepted < proposed  # drafts were both kept and rejected
    if engine == "preempted":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    llm.shutdown()


@pytest.fixture(scope="module")
def self_drafting(llama_dir) -> LLM:
    """The target as its own draft: every greedy draft is accepted, so verify steps yield runs of k + 1 tokens, and
    a stop rule at a token inside a run must cut the run there."""
    return LLM(llama_dir, speculative_config=draft_config(llama_dir, k=3))


def stop_inside_runs(baseline: LLM, rule: str) -> tuple[SamplingParams | list[SamplingParams], frozenset[int]]:
    """The rule's settings for each of PROMPTS[:4] (and the engine's EOS ids), placed at the 7th greedy output token
    (stop strings: about a third into the text): in the run of output tokens 5-8 of a self-drafting engine (token 0
    comes with the prompt, then runs of 4)."""
    free = [output[0] for output in completions(baseline, GREEDY, PROMPTS[:4])]
    at = [token_ids[6] for token_ids, *_ in free]
    if rule == "eos":
        return SamplingParams(temperature=0, max_tokens=24), frozenset(at)
    if rule == "stop_token_ids":
        return [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token]) for token in at], frozenset()
    if rule == "max_tokens":
        return SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), frozenset()
    # Two characters from a third into the text (found there, or earlier), none of them half a character.
    stops = [next(t[i : i + 2] for i in range(len(t) // 3, len(t)) if "\ufffd" not in t[i : i + 2]) for *_, t in free]
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]) for stop in stops], frozenset()


@pytest.mark.parametrize("rule", ["eos", "stop_token_ids", "stop_strings", "max_tokens"])
def test_a_stop_inside_a_run_of_accepted_drafts_ends_the_output_there(baseline, self_drafting, rule):
    params, eos_token_ids = stop_inside_runs(baseline, rule)
    for llm in (baseline, self_drafting):
        llm.llm_engine.eos_token_ids = eos_token_ids
    try:
        expected = completions(baseline, params, PROMPTS[:4])
        records = Records(self_drafting)
        assert completions(self_drafting, params, PROMPTS[:4]) == expected
    finally:
        for llm in (baseline, self_drafting):
            llm.llm_engine.eos_token_ids = frozenset()
    assert all(len(sample[0]) < 24 for output in expected for sample in output)  # each stopped early
    # Every draft was accepted; the verify steps yielded each accepted draft and one token more, and every output
    # token but the first (sampled with the prompt): more than the outputs kept, since runs were cut at the stops
    # (max_tokens cuts none: drafts are trimmed to the tokens a request may still generate).
    assert records.total("num_accepted_tokens") == records.total("num_draft_tokens") > 0
    yielded = records.total("num_accepted_tokens") + records.total("num_drafts")
    from_verify_steps = sum(len(sample[0]) - 1 for output in expected for sample in output)
    assert yielded == from_verify_steps if rule == "max_tokens" else yielded > from_verify_steps


def test_n_samples_each_speculate_on_their_own(baseline, self_drafting):
    """Greedy samples equal those without speculation; seeded ones (sample i seeded seed + i, its drafts drawn from
    a generator of its own) repeat their tokens, and differ from each other."""
    params = [SamplingParams(temperature=0, n=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=16, ignore_eos=True)] * 2  # fmt: skip
    outputs = completions(self_drafting, params, PROMPTS[:4])
    assert outputs[::2] == completions(baseline, params, PROMPTS[:4])[::2]
    assert outputs[1::2] == completions(self_drafting, params, PROMPTS[:4])[1::2]
    assert all(first[0] != second[0] for first, second in outputs[1::2])


def test_sampled_drafts_of_the_target_itself_are_all_but_always_accepted(self_drafting):
    """The target as its own draft at temperature > 0: q is p (up to rounding), so the rejection rule keeps nearly
    every draft (drafts of the argmax would be kept only as often as p gives the argmax)."""
    params = [
        SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, max_tokens=16, ignore_eos=True),
    ]
    records = Records(self_drafting)
    assert lengths(completions(self_drafting, params * 2, PROMPTS[:4])) == [[16]] * 4
    proposed, accepted = records.total("num_draft_tokens"), records.total("num_accepted_tokens")
    assert proposed > 0 and accepted >= 0.95 * proposed
    with_logprobs = SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, logprobs=2)
    for output in self_drafting.generate(PROMPTS[:2], with_logprobs, use_tqdm=False):  # each of the token kept
        sample = output.outputs[0]
        assert len(sample.logprobs) == 8 and all(t in p for t, p in zip(sample.token_ids, sample.logprobs))


def test_sampled_drafts_complete_and_seeded_runs_repeat(llama_dir, near_draft_dir):
    """A draft near the target, non-greedy requests on every sampler path: drafts are kept and rejected, every
    request completes, no block stays held, and a second pass gives each seeded request its tokens again (its
    drafts and its verify rows draw from generators of its own; prefix caching off, so the passes run alike)."""
    llm = LLM(llama_dir, speculative_config=draft_config(near_draft_dir), enable_prefix_caching=False)
    records = Records(llm)
    unseeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True)
    first = completions(llm, [*SEEDED, unseeded], PROMPTS[:5])
    assert lengths(first) == [[16], [16], [16], [16, 16], [16]]
    proposed, accepted = records.total("num_draft_tokens"), records.total("num_accepted_tokens")
    assert 0 < accepted < proposed
    assert records.total("num_drafts") <= proposed <= 3 * records.total("num_drafts")  # k = 3
    assert completions(llm, SEEDED, PROMPTS[:4]) == first[:4]
    llm.shutdown()


def test_logprobs_of_accepted_drafts_are_their_rows(baseline, self_drafting):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    expected = baseline.generate(PROMPTS[:3], params, use_tqdm=False)
    for output, reference in zip(self_drafting.generate(PROMPTS[:3], params, use_tqdm=False), expected):
        sample, wanted = output.outputs[0], reference.outputs[0]
        assert sample.token_ids == wanted.token_ids
        for position, wanted_position in zip(sample.logprobs, wanted.logprobs):
            assert position.keys() == wanted_position.keys()
            for token_id, logprob in position.items():
                assert logprob.logprob == pytest.approx(wanted_position[token_id].logprob, abs=1e-4)


def test_async_scheduling_verifies_synchronously_and_overlaps_again_once_back_off_holds_everyone(
    llama_dir, tiny_model_dirs, expected
):
    """Under async scheduling a verify step is planned only with no step in flight and read back before the next is
    scheduled. A draft model of other random weights is never right: back-off pauses every request, and steps are
    scheduled ahead again (NOT_PROPOSED: planned while another was in flight)."""
    other_draft = tiny_model_dirs["llama3_rope_tied"]  # the same tokenizer, other weights
    llm = LLM(llama_dir, async_scheduling=True, speculative_config=draft_config(other_draft))
    pipeline = llm.llm_engine.pipeline
    launch = pipeline.launch

    def checked_launch(previous):
        launched = launch(previous)
        assert launched is None or launched.verify_offsets is None or previous is None
        return launched

    pipeline.launch = checked_launch
    records = Records(llm)
    long_greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    assert completions(llm, GREEDY) == expected["greedy"]
    completions(llm, long_greedy, PROMPTS[:2])
    choices = [record.speculation for record in records.steps]
    assert VERIFIED in choices and records.total("num_accepted_tokens") < records.total("num_draft_tokens")
    assert NOT_PROPOSED in choices[choices.index(VERIFIED) :]  # overlapped steps after speculation was paused
    assert records.steps[-1].num_paused == 0 or records.steps[-1].speculation == NOT_PROPOSED
    llm.shutdown()


def test_a_batch_above_disable_by_batch_size_does_not_speculate(llama_dir, baseline):
    llm = LLM(llama_dir, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    records = Records(llm)
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert completions(llm, params) == completions(baseline, params)
    choices = [record.speculation for record in records.steps]
    assert BATCH_TOO_LARGE in choices and VERIFIED in choices  # the last requests running speculated
    for record in records.steps[1:]:  # all are admitted by the first step: the batch only shrinks after it
        assert record.speculation != VERIFIED or record.num_running <= 3
        assert record.speculation != BATCH_TOO_LARGE or record.num_draft_tokens == 0


def test_structured_outputs_verify_only_drafts_their_grammar_allows(llama_dir, baseline):
    """The n-gram drafts of a constrained request are cut at the first its grammar refuses; each verify row is
    masked as the grammar stands after the drafts before it, and the matcher takes exactly the accepted tokens."""
    pytest.importorskip("llguidance")
    from pagedllm import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["ab", "cd"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constraint = StructuredOutputsParams(json=schema, whitespace_pattern="")
    prompts = ['{"name":"ab","age":12}{"name":"cd","age":3}' * 3] * 8
    params = [SamplingParams(temperature=0.5 * (i % 3), seed=i, max_tokens=40, structured_outputs=constraint)
              for i in range(len(prompts))]  # fmt: skip
    llm = LLM(llama_dir, speculative_config=NGRAM)
    records = Records(llm)
    outputs = completions(llm, params, prompts)
    assert outputs == completions(baseline, params, prompts)
    for output in outputs:
        value = json.loads(output[0][3])
        assert value["name"] in ("ab", "cd") and isinstance(value["age"], int)
    assert 0 < records.total("num_accepted_tokens") < records.total("num_draft_tokens")
