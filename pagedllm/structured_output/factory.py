"""Which structured-output backend an engine gets: llguidance, the one implementation, imported here and only when
asked for; the interface (backend.py) imports no implementation."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.structured_output.backend import INSTALL_HINT, StructuredOutputBackend, StructuredOutputsUnavailable


def load_backend(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> StructuredOutputBackend:
    """The engine's backend for its Hugging Face tokenizer, a model vocabulary of vocab_size logits and the ids that
    end a sequence (empty when the model has none); StructuredOutputsUnavailable without the `structured` extra."""
    try:
        from pagedllm.structured_output.llguidance_backend import LLGuidanceBackend
    except ImportError as error:
        if not (error.name or "").startswith("llguidance"):
            raise
        raise StructuredOutputsUnavailable(
            f"structured outputs need the llguidance library, which is not installed; install it with `{INSTALL_HINT}`"
        ) from error
    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
