"""The llguidance backend: a constraint becomes an llguidance grammar whose matcher is built once, in its start state,
and copied for every sample (a copy costs about a microsecond; building can take a second for a large schema).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import llguidance
import llguidance.hf
import numpy as np
from transformers import PreTrainedTokenizerFast

from pagedllm.structured_output.backend import CompiledGrammar, GrammarMatcher, StructuredOutputBackend
from pagedllm.structured_output.params import StructuredOutputsParams

# What each kind's error message calls the field that failed.
FIELD_NAMES = {
    "json": "structured_outputs.json (a JSON schema)",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


class LLGuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, but the engine has none")
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(
                f"structured outputs need a fast (Rust-backed) Hugging Face tokenizer, got {type(tokenizer).__name__}"
            )
        tokenizer_size = len(tokenizer)
        self.vocab_size = max(vocab_size, tokenizer_size)
        end_tokens = sorted(token for token in set(eos_token_ids) if token < tokenizer_size)
        self.end_tokens = frozenset(end_tokens)
        # llguidance needs an end token. A model without one gets a special token standing in for it, whose bit is
        # cleared from every mask: such a sequence ends when its matcher is terminated, or at its length limit.
        stand_in = min(tokenizer.all_special_ids, default=None) if not end_tokens else None
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab_size, eos_token=end_tokens or stand_in
            )
        except ValueError as error:
            raise ValueError(f"llguidance cannot use this tokenizer: {error}") from None
        self.hidden_end_token = None if end_tokens else self.ll_tokenizer.eos_token

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        if params.whitespace_pattern is not None:
            problem = llguidance.LLMatcher.validate_grammar(
                llguidance.LLMatcher.grammar_from_regex(params.whitespace_pattern)
            )
            if problem:
                raise ValueError(f"structured_outputs.whitespace_pattern is not a valid regex: {problem.strip()}")
        field = FIELD_NAMES[params.kind]
        try:
            grammar = llguidance_grammar(params)
        except ValueError as error:
            raise ValueError(f"{field} cannot be compiled: {error}") from None
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"{field} cannot be compiled: {template.get_error().strip()}")
        return LLGuidanceGrammar(template, self.end_tokens, self.hidden_end_token)


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of one constraint (its errors show when a matcher is built from it)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_pattern": params.whitespace_pattern} if params.whitespace_pattern is not None else None
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema(), overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_grammar(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark as is; GBNF converted to Lark


def choice_grammar(choices: list[str]) -> str:
    """A Lark rule matching exactly one of the strings. Lark string literals take JSON's escapes, so each string is
    written as a JSON string (quotes, backslashes and control characters escaped; other text kept as UTF-8)."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher, end_tokens: frozenset[int], hidden_end_token: int | None):
        self.template = template  # never advanced: each matcher starts from a copy of it
        self.end_tokens = end_tokens
        self.hidden_end_token = hidden_end_token

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.end_tokens, self.hidden_end_token)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, end_tokens: frozenset[int], hidden_end_token: int | None):
        self.matcher = matcher
        self.end_tokens = end_tokens
        self.hidden_end_token = hidden_end_token

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.hidden_end_token:
            return False
        if self.matcher.is_stopped():  # llguidance takes an end token here without counting it
            return token_id in self.end_tokens
        # try_consume_tokens leaves the matcher as it was when the token is refused (consume_token would not)
        return self.matcher.try_consume_tokens([token_id]) == 1

    def fill_bitmask(self, row: np.ndarray) -> None:
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags.c_contiguous:
            raise ValueError(f"a bitmask row must be 1-D C-contiguous int32, got {row.ndim}-D {row.dtype}")
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # llguidance checks the size
        if self.hidden_end_token is not None:
            word, bit = divmod(self.hidden_end_token, 32)
            row.view(np.uint32)[word] &= ~np.uint32(1 << bit)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def can_end(self) -> bool:
        return self.matcher.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        # Rolling back more than was accepted is the caller's bug, and llguidance leaves the matcher broken.
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.matcher.get_error().splitlines()[0]}")

    def reset(self) -> None:
        self.matcher.reset()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.matcher.deep_copy(), self.end_tokens, self.hidden_end_token)
