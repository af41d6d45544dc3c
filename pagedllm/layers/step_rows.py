"""Which rows of the step a model's forward computes belong to prompt chunks, for the linear methods that multiply
them apart from the rows that decode (gguf.py on CPU: prompt rows through the weight in float, decoding rows through
the grouped-integer kernel).

A row decodes when its sequence is past its prompt and computes few tokens this step (a decode or a verify row): the
attention backends' own split (torch_backend.decodes). The model's forward names its step
(`computing`); a product outside a forward (a warm-up, a test) sees no step, and every row counts as decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import decodes

_step: ContextVar[AttentionMetadata | None] = ContextVar("pagedllm_step", default=None)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A step's prompt rows and decoding rows as row indices (int64); `decoding` None: every row is a prompt row."""

    prompt: torch.Tensor
    decoding: torch.Tensor | None


@contextmanager
def computing(metadata: AttentionMetadata) -> Iterator[None]:
    """The products inside this block belong to the step `metadata` describes."""
    token = _step.set(metadata)
    try:
        yield
    finally:
        _step.reset(token)


def prompt_rows() -> PromptRows | None:
    """The current step's prompt rows, or None where it has none (or no step is being computed)."""
    metadata = _step.get()
    if metadata is None or metadata.decode_only:
        return None
    return metadata.once("step_rows.prompt_rows", lambda: split(metadata))


def split(metadata: AttentionMetadata) -> PromptRows | None:
    starts = metadata.query_start_loc.tolist()
    prompt, decoding_rows = [], []
    for index in range(len(starts) - 1):
        start, end = starts[index], starts[index + 1]
        (decoding_rows if decodes(metadata, index, end - start) else prompt).extend(range(start, end))
    if not prompt:
        return None
    return PromptRows(torch.tensor(prompt), torch.tensor(decoding_rows) if decoding_rows else None)
