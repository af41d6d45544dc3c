"""A request that nobody streams and that has no stop strings gets its text decoded once, when it ends; a streamed
request token by token. Both give the same outputs: at a length limit, at a stop token (its text left out or
included), with special tokens kept, for n > 1, after a prompt that ends inside a character (which is decoded
token by token either way), and for a batch whose requests end at different steps, async scheduling on and off."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLM(llama_dir, num_kv_blocks=64).llm_engine


def run(engine, prompt, params: SamplingParams, stream: bool) -> tuple[bool, list[tuple]]:
    """(whether sample 0 decodes its text at the end, each sample's text, tokens and finish and stop reasons)."""
    engine.add_request("r", prompt, params, stream=stream)
    text_at_end = engine.requests["r"].samples[0].text_at_end
    final = None
    while engine.has_unfinished_requests():
        final = next((output for output in engine.step() if output.finished), final)
    completions = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in final.outputs]
    return text_at_end, completions


def test_text_decoded_at_the_end_equals_token_by_token(engine):
    free_tokens = run(engine, PROMPT, GREEDY, stream=False)[1][0][1]
    stop_token = free_tokens[5]  # the greedy run stops at its 6th token (or at an earlier copy of it)
    cases = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, skip_special_tokens=False),
        SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True),
    ]
    for params in cases:
        at_end, outputs_at_end = run(engine, PROMPT, params, stream=False)
        by_token, outputs_by_token = run(engine, PROMPT, params, stream=True)
        assert at_end and not by_token
        assert outputs_at_end == outputs_by_token, params
    assert run(engine, PROMPT, cases[1], stream=False)[1][0][2:] == ("stop", stop_token)


def test_prompt_ending_inside_a_character_is_decoded_token_by_token(engine):
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode("A glass of 🍷")[:-1]  # the glass's last byte is missing
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    at_end, outputs = run(engine, {"prompt_token_ids": prompt_ids}, GREEDY, stream=False)
    assert not at_end
    assert outputs == run(engine, {"prompt_token_ids": prompt_ids}, GREEDY, stream=True)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_ending_at_different_steps_gets_each_requests_streamed_text(llama_dir, async_scheduling):
    llm = LLM(llama_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    prompts = ["The quick brown fox", "A glass of", "def f(x):", "Once upon a time"]
    free = llm.generate(prompts, GREEDY, use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * index, stop_token_ids=[output.outputs[0].token_ids[2 + index]])
        for index, output in enumerate(free)
    ]  # each ends at a stop token or its own max_tokens, at a step of its own
    batched = llm.generate(prompts, params, use_tqdm=False)  # not streamed: text made at the end
    engine = llm.llm_engine
    for prompt, request_params, output in zip(prompts, params, batched):
        alone = run(engine, prompt, request_params, stream=True)[1]
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in output.outputs] == alone
    assert len({len(output.outputs[0].token_ids) for output in batched}) > 1
