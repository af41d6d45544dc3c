"""Stop strings, stop tokens and min_tokens in the engine loop: the text ends before the stop string (or through it
with include_stop_str_in_output), finish_reason and stop_reason as vLLM's, a stream never shows text that a stop
string later removes, and with async scheduling the step in flight when the stop is found leaks nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer

PROMPT = "The quick brown fox"
NUM_TOKENS = 24
FREE = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, num_kv_blocks=64)


@pytest.fixture(scope="module")
def free_run(llm) -> tuple[list[int], list[str]]:
    """The greedy continuation: its tokens, and the text after each token."""
    token_ids = llm.generate(PROMPT, FREE, use_tqdm=False)[0].outputs[0].token_ids
    detokenizer = IncrementalDetokenizer(llm.get_tokenizer(), llm.get_tokenizer().encode(PROMPT))
    texts = []
    for token_id in token_ids:
        detokenizer.update([token_id])
        texts.append(detokenizer.text)
    return token_ids, texts


def boundary_stops(texts: list[str]) -> list[tuple[int, str]]:
    """(k, stop): two-character stop strings made of the last character of token k's text and the first of token
    k + 1's, found nowhere earlier in the text, so they end the text within token k + 1."""
    full = texts[-1]
    stops = []
    for k in range(len(texts) - 1):
        end = len(texts[k])
        if end == 0 or len(texts[k + 1]) == end:  # no text yet, or token k + 1 adds none
            continue
        stop = full[end - 1 : end + 1]
        if "\ufffd" not in stop and full.find(stop) == end - 1:
            stops.append((k, stop))
    return stops


def generate(llm: LLM, params: SamplingParams):
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_across_a_token_boundary(llm, free_run):
    token_ids, texts = free_run
    stops = boundary_stops(texts)
    assert len(stops) >= 2, "the test needs stop strings that span two tokens"
    for k, stop in stops[:3]:
        output = generate(llm, replace(FREE, stop=[stop]))
        assert output.text == texts[k][:-1]  # ends before the stop string's first character
        assert output.token_ids == token_ids[: k + 2]  # through the token that completed it
        assert (output.finish_reason, output.stop_reason) == ("stop", stop)
        included = generate(llm, replace(FREE, stop=[stop], include_stop_str_in_output=True))
        assert included.text == texts[k] + stop[1] and included.token_ids == token_ids[: k + 2]


def test_the_earliest_of_several_stop_strings_wins(llm, free_run):
    token_ids, texts = free_run
    (early, early_stop), (late, late_stop) = boundary_stops(texts)[0], boundary_stops(texts)[-1]
    assert early < late
    output = generate(llm, replace(FREE, stop=[late_stop, "no such text", early_stop]))
    assert (output.text, output.stop_reason, output.token_ids) == (texts[early][:-1], early_stop,
                                                                   token_ids[: early + 2])  # fmt: skip


def test_stop_token_ids_and_eos_set_stop_reason(llm, free_run):
    token_ids, texts = free_run
    stop_token = token_ids[5]
    first = token_ids.index(stop_token)
    output = generate(llm, replace(FREE, stop_token_ids=[stop_token]))
    assert output.token_ids == token_ids[: first + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop_token)
    assert output.text == (texts[first - 1] if first else "")  # the stop token's own text is left out
    included = generate(llm, replace(FREE, stop_token_ids=[stop_token], include_stop_str_in_output=True))
    assert included.text == texts[first]
    engine = llm.llm_engine
    engine.eos_token_ids = frozenset({stop_token})
    try:
        eos_ended = generate(llm, SamplingParams(temperature=0, max_tokens=NUM_TOKENS))
    finally:
        engine.eos_token_ids = frozenset()
    assert eos_ended.token_ids == token_ids[: first + 1]
    assert (eos_ended.finish_reason, eos_ended.stop_reason) == ("stop", None)


def test_min_tokens_holds_back_stop_strings(llm, free_run):
    """A stop string that the text reaches before min_tokens tokens does not count; its next occurrence does."""
    token_ids, texts = free_run
    full = texts[-1]
    stop = max(set(full), key=lambda char: (full.count(char) >= 2, -full.find(char)))
    first = next(k for k, text in enumerate(texts) if stop in text)
    second = next(k for k, text in enumerate(texts) if text.count(stop) >= 2)
    assert first < second, "the test needs a character that comes twice, in different tokens"
    output = generate(llm, replace(FREE, stop=[stop]))
    assert output.token_ids == token_ids[: first + 1] and output.text == full[: full.find(stop)]
    held = generate(llm, replace(FREE, stop=[stop], min_tokens=first + 2))
    later = full.find(stop, len(texts[first]))  # the first occurrence in text that comes after min_tokens - 1 tokens
    ends_in = next(k for k, text in enumerate(texts) if len(text) > later)
    assert held.token_ids == token_ids[: max(ends_in, first + 1) + 1] and held.text == full[:later]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streaming_never_shows_text_a_stop_string_removes(llama_dir, free_run, async_scheduling):
    token_ids, texts = free_run
    llm = LLM(llama_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    k, stop = boundary_stops(texts)[-1]
    longer_stop = texts[-1][len(texts[k]) - 1 : len(texts[k]) + 4]  # five characters: holds back four
    engine.add_request("s", PROMPT, replace(FREE, stop=["never", longer_stop]))
    streamed = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert -1 not in output.outputs[0].token_ids  # no placeholder of the step in flight
            streamed.append(output.outputs[0])
    final = streamed[-1]
    assert final.finished() and final.text == texts[k][:-1] and final.stop_reason == longer_stop
    assert all(final.text.startswith(output.text) for output in streamed)
    assert any(len(output.text) < len(texts[len(output.token_ids) - 1]) for output in streamed[:-1])  # held back
    assert [len(output.token_ids) for output in streamed] == list(range(1, k + 3))  # every step, in order


def test_async_stop_found_a_step_late_leaks_nothing(llama_dir, free_run):
    """With async scheduling the step after the stop string's token is already queued: its token must not reach
    the output, its blocks must come back, and the other requests must be untouched."""
    token_ids, texts = free_run
    stops = boundary_stops(texts)
    prompts = [PROMPT] * len(stops) + [PROMPT]
    params = [replace(FREE, stop=[stop]) for _, stop in stops] + [FREE]
    sync = LLM(llama_dir, num_kv_blocks=64, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    overlapped = LLM(llama_dir, num_kv_blocks=64, async_scheduling=True)
    outputs = overlapped.generate(prompts, params, use_tqdm=False)
    for (k, stop), output in zip(stops, outputs):
        assert output.outputs[0].token_ids == token_ids[: k + 2] and output.outputs[0].stop_reason == stop
    assert [o.outputs[0] for o in outputs] == [o.outputs[0] for o in sync]
    assert outputs[-1].outputs[0].token_ids == token_ids
    block_manager = overlapped.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks and not overlapped.llm_engine.requests


def test_each_sample_of_n_stops_on_its_own(llm):
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    free = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    stop = free[1].text[3:5]
    stopped = llm.generate(PROMPT, replace(params, stop=[stop]), use_tqdm=False)[0].outputs
    for before, after in zip(free, stopped):
        if stop in before.text:
            assert after.text == before.text[: before.text.find(stop)] and after.stop_reason == stop
        else:
            assert (after.text, after.token_ids, after.finish_reason) == (before.text, before.token_ids, "length")
    assert stopped[1].finish_reason == "stop"
