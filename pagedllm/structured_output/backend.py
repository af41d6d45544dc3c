"""The interface a structured-output library implements: compile a constraint once, then match it per sample.

A bitmask row holds one bit per token id (bit t % 32 of int32 word t // 32; 1 = allowed), as llguidance and
xgrammar lay it out. The engine's backend comes from `factory.load_backend`; today that is llguidance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from pagedllm.structured_output.params import StructuredOutputsParams

INSTALL_HINT = "pip install 'pagedllm[structured]'"


class StructuredOutputsUnavailable(ImportError, ValueError):
    """The structured-output library is not installed. A ValueError too, so the engine refuses the request (an HTTP
    400) rather than failing."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row of a vocabulary this large."""
    return (vocab_size + 31) // 32


class GrammarMatcher(ABC):
    """One sample's position in its grammar. Its sequence ends once is_terminated(); until then fill_bitmask gives
    at least one allowed token."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and nothing changes) if the grammar does not allow it. Once
        terminated, an end (EOS) token is accepted and changes nothing, so rollback does not count it."""

    @abstractmethod
    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into `row`: C-contiguous int32 of the backend's bitmask_words (a row of a
        2-D plan array, or a CPU tensor's .numpy() view). An end token is allowed only where can_end()."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: no token but an end token can follow."""

    @abstractmethod
    def can_end(self) -> bool:
        """The output so far satisfies the grammar, so an end (EOS) token is allowed now."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (for preemption that drops tokens, or rejected drafts)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the output, as a fresh matcher."""

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (for the samples of n > 1 that fork from sample 0)."""


class CompiledGrammar(ABC):
    """A constraint compiled once and shared by every sample that uses it; it never changes after compile."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""


class StructuredOutputBackend(ABC):
    """Built once per engine from its tokenizer; compile() may run on a worker thread while the engine steps."""

    vocab_size: int  # token ids a bitmask row covers: the model's vocabulary (or the tokenizer's, if larger)

    @property
    def bitmask_words(self) -> int:
        return bitmask_words(self.vocab_size)

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """ValueError naming the field and what the library found wrong (bad JSON schema, an unsupported schema
        keyword, a bad regex or grammar)."""
