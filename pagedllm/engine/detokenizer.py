"""Incremental detokenization: each new token's text, held back until it forms whole UTF-8 characters."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer under a transformers fast tokenizer
        # Seeded with the prompt so the first output token decodes in context (e.g. its leading space).
        self.stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=True)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text it completes (possibly empty)."""
        delta = self.stream.step(self.backend, token_id) or ""
        self.text += delta
        return delta
