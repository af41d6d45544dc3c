"""Incremental detokenization: the streamed pieces add up to the full decode and never split a character; stop
strings end the text even across tokens; streamed text never shows what a stop string removes."""

from __future__ import annotations

import pytest
from conftest import VOCAB_SIZE, train_tokenizer
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling.params import SamplingParams

TEXT = " France is Paris, the capital. The end."


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def run(tokenizer, params: SamplingParams) -> tuple[IncrementalDetokenizer, list[tuple[str, str]], int]:
    """Feed TEXT's tokens one by one until a stop string ends it; returns the detokenizer, (what a stream showed,
    the whole text so far) after each token, and how many tokens were fed."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("The capital of"), params)
    shown = []
    num_fed = 0
    for token_id in tokenizer.encode(TEXT):
        num_fed += 1
        stop = detokenizer.update([token_id])
        if stop is not None:
            break
        shown.append((detokenizer.output_text(finished=False), detokenizer.text))
    detokenizer.finish()
    return detokenizer, shown, num_fed


def tokens_until(tokenizer, substring: str) -> int:
    """How many of TEXT's tokens it takes for their text to contain substring."""
    ids = tokenizer.encode(TEXT)
    return next(n for n in range(1, len(ids) + 1) if substring in tokenizer.decode(ids[:n]))


def test_streamed_text_equals_full_decode(tokenizer):
    prompt = tokenizer.encode("The capital of")
    text = " France is Paris — café 🍷 naïve 東京 def f(x): return x**2"
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for token_id in output_ids:
        num_chars = len(detokenizer.text)
        detokenizer.update([token_id])
        pieces.append(detokenizer.text[num_chars:])
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(output_ids)
    assert all("\ufffd" not in piece for piece in pieces)  # multi-byte characters wait until complete
    assert any(piece == "" for piece in pieces)  # ...which this byte-level text forces at least once


def test_stop_string_across_tokens_ends_the_text_before_it(tokenizer):
    assert tokens_until(tokenizer, "is Pa") - tokens_until(tokenizer, "i") == 2  # " is", " ", "Paris"
    detokenizer, _, num_fed = run(tokenizer, SamplingParams(stop=["is Pa"]))
    assert detokenizer.text == " France " and detokenizer.stop_reason == "is Pa"
    assert num_fed == tokens_until(tokenizer, "is Pa")  # it stops on the token that completes the stop string


def test_earliest_of_several_stop_strings_wins_whatever_their_order(tokenizer):
    # Both complete on the token " capital"; "capi" starts first.
    detokenizer, _, _ = run(tokenizer, SamplingParams(stop=["The end", "pital", "capi"]))
    assert detokenizer.text == " France is Paris, the " and detokenizer.stop_reason == "capi"


def test_include_stop_str_in_output_keeps_it_and_drops_what_follows(tokenizer):
    detokenizer, shown, _ = run(tokenizer, SamplingParams(stop=["capi"], include_stop_str_in_output=True))
    assert detokenizer.text == " France is Paris, the capi"  # "tal" came in the same token: gone
    assert shown[-1] == (" France is Paris, the",) * 2  # no holdback needed: nothing shown can be removed


@pytest.mark.parametrize("stop", [["is Pa"], ["Paris, the", "x"], ["e"], [" The end.", "ital"]])
def test_streaming_never_shows_text_that_a_stop_string_removes(tokenizer, stop):
    detokenizer, shown, _ = run(tokenizer, SamplingParams(stop=stop))
    final = detokenizer.output_text(finished=True)
    assert final == detokenizer.text and detokenizer.stop_reason is not None
    assert all(final.startswith(streamed) for streamed, _ in shown), (shown, final)
    held_back = any(streamed != text for streamed, text in shown)
    assert held_back == (max(map(len, stop)) > 1)  # a one-character stop string removes nothing already decoded


def test_stream_deltas_add_up_to_the_final_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [5], SamplingParams(stop=["capital."]))
    deltas, num_shown = [], 0
    for token_id in tokenizer.encode(TEXT):
        finished = detokenizer.update([token_id]) is not None
        shown = detokenizer.output_text(finished)
        deltas.append(shown[num_shown:])
        num_shown = len(shown)
        if finished:
            break
    assert "".join(deltas) == " France is Paris, the " and any(deltas) and "" in deltas


def test_stop_strings_wait_for_min_tokens(tokenizer):
    # " is" is the second token: too early with min_tokens=3, so the next "is", inside "Paris", stops it.
    detokenizer, _, _ = run(tokenizer, SamplingParams(stop=["is"], min_tokens=3))
    assert detokenizer.text == " France is Par"
    detokenizer, _, _ = run(tokenizer, SamplingParams(stop=["is"]))
    assert detokenizer.text == " France "


def test_stop_token_text_is_left_out_unless_included(tokenizer):
    ids = tokenizer.encode(" the capital")
    for include, expected in ((False, " the"), (True, " the capital")):
        detokenizer = IncrementalDetokenizer(tokenizer, [5], SamplingParams(include_stop_str_in_output=include))
        detokenizer.update(ids, stop_terminated=True)
        assert detokenizer.text == expected


def test_incomplete_trailing_character_shows_as_replacement_when_finished(tokenizer):
    ids = tokenizer.encode("x 🍷")[:-1]  # the glass's last byte never came
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("The"))
    for token_id in ids:
        detokenizer.update([token_id])
    assert detokenizer.text == "x "  # while running, half a character waits
    detokenizer.finish()
    assert detokenizer.text == tokenizer.decode(ids) == "x \ufffd"


def test_a_prompt_ending_inside_a_character_stays_out_of_the_output(tokenizer):
    """The prompt's dangling bytes show at most as one U+FFFD before the output's own text; the prompt's text never
    does (a DecodeStream seeded with such a prompt returned all of it with the first piece)."""
    prompt = tokenizer.encode("The capital of") + tokenizer.encode("é")[:1]  # the first of its two bytes
    assert tokenizer.decode(prompt).endswith("\ufffd")
    output = tokenizer.encode("cat-233 is here")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    for token_id in output:
        detokenizer.update([token_id])
    detokenizer.finish()
    assert detokenizer.text in (tokenizer.decode(output), "\ufffd" + tokenizer.decode(output))
    completed = IncrementalDetokenizer(tokenizer, prompt)  # the output's first byte completes the character
    completed.update(tokenizer.encode("é")[1:] + output)
    assert completed.text == "é" + tokenizer.decode(output)
    lone_bytes = tokenizer.encode("é")[1:] * 6  # continuation bytes that no later byte makes a character
    garbled = IncrementalDetokenizer(tokenizer, tokenizer.encode("The capital of") + lone_bytes)
    garbled.update(output)
    assert "capital" not in garbled.text and garbled.text.endswith(tokenizer.decode(output))


def test_skip_special_tokens(tokenizer):
    bos = tokenizer.convert_tokens_to_ids("<s>")
    ids = tokenizer.encode(" the") + [bos] + tokenizer.encode(" end")
    for skip, expected in ((True, " the end"), (False, " the<s> end")):
        detokenizer = IncrementalDetokenizer(tokenizer, [5], SamplingParams(skip_special_tokens=skip))
        detokenizer.update(ids)
        detokenizer.finish()
        assert detokenizer.text == expected == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt_text=st.text(min_size=1, max_size=12),
    output=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24),
    skip_special_tokens=st.booleans(),
    stop_terminated=st.booleans(),
    include_stop_str_in_output=st.booleans(),
)
def test_decoding_the_whole_output_at_once_equals_token_by_token(
    tokenizer, prompt_text, output, skip_special_tokens, stop_terminated, include_stop_str_in_output
):
    """Any output ids, byte pieces that form no character and special tokens included: what a request that nobody
    streams gets at its end equals what a streamed one accumulates (after a prompt of whole characters)."""
    params = SamplingParams(
        skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop_str_in_output
    )
    assume(not prompt_text.endswith("\ufffd"))
    prompt = tokenizer.encode(prompt_text)
    by_token = IncrementalDetokenizer(tokenizer, prompt, params)
    for index, token_id in enumerate(output):
        by_token.update([token_id], stop_terminated=stop_terminated and index == len(output) - 1)
    by_token.finish()
    at_once = IncrementalDetokenizer(tokenizer, prompt, params)
    assert at_once.can_decode_at_end()
    at_once.decode_all(output, stop_terminated=stop_terminated)
    assert at_once.text == by_token.text
    assert at_once.num_output_tokens == by_token.num_output_tokens == len(output)
