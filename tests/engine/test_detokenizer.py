"""Incremental detokenization: the streamed pieces add up to the full decode, and never split a character."""

from __future__ import annotations

from conftest import train_tokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer


def test_streamed_text_equals_full_decode():
    tokenizer = train_tokenizer()
    prompt = tokenizer.encode("The capital of")
    text = " France is Paris — café 🍷 naïve 東京 def f(x): return x**2"
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token_id) for token_id in output_ids]
    assert "".join(pieces) == detokenizer.text == tokenizer.decode(output_ids)
    assert all("\ufffd" not in piece for piece in pieces)  # multi-byte characters wait until complete
    assert any(piece == "" for piece in pieces)  # ...which this byte-level text forces at least once
