"""Without llguidance the backend cannot be built, and the error says which extra installs it (a ValueError too, so
the engine refuses the request instead of failing)."""

from __future__ import annotations

import sys

import pytest
from conftest import VOCAB_SIZE, train_tokenizer

from pagedllm.structured_output.backend import StructuredOutputsUnavailable, bitmask_words
from pagedllm.structured_output.factory import load_backend


def test_without_llguidance_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    monkeypatch.delitem(sys.modules, "pagedllm.structured_output.llguidance_backend", raising=False)
    with pytest.raises(StructuredOutputsUnavailable, match=r"pip install 'pagedllm\[structured\]'") as raised:
        load_backend(train_tokenizer(), VOCAB_SIZE, [])
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, ImportError)


def test_bitmask_words():
    assert [bitmask_words(size) for size in (1, 32, 33, 49152, 151936)] == [1, 1, 2, 1536, 4748]
