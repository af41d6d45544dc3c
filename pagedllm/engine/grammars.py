"""Structured outputs in the engine: a request waits here, outside the scheduler, while its grammar compiles on the
GrammarCompiler's thread; once it is ready each of the request's samples gets a matcher (SampleGrammar) that fills
its step's mask rows (fill_masks, while the device runs the step's forward) and follows its tokens (advance_grammar,
as soon as they are read back).
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pagedllm.logger import logger
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import Sequence
from pagedllm.structured_output.backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    bitmask_words,
)
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.factory import load_backend


class SampleGrammar:
    """One sample's matcher (Sequence.grammar), and how it writes that sample's row of a plan's token_bitmask."""

    __slots__ = ("matcher", "num_words", "stop_token_ids", "scratch")

    def __init__(self, matcher: GrammarMatcher, num_words: int, backend_words: int, stop_token_ids: list[int]):
        self.matcher = matcher
        self.num_words = num_words  # a plan row's words: the model's vocabulary
        # Like EOS, the request's stop tokens may end the output only where the grammar may end.
        self.stop_token_ids = stop_token_ids
        # A tokenizer larger than the model's vocabulary makes the backend's rows longer: its tokens past the
        # model's logits can never be sampled, so a row keeps the first num_words words.
        self.scratch = np.empty(backend_words, dtype=np.int32) if backend_words > num_words else None

    def fill(self, row: np.ndarray) -> None:
        """row: C-contiguous int32 [num_words]."""
        if self.scratch is None:
            self.matcher.fill_bitmask(row)
        else:
            self.matcher.fill_bitmask(self.scratch)
            row[:] = self.scratch[: len(row)]
        if self.stop_token_ids and self.matcher.can_end():
            words = row.view(np.uint32)
            for token_id in self.stop_token_ids:
                words[token_id // 32] |= np.uint32(1 << (token_id % 32))


def constrained_rows(owners: list[Sequence]) -> np.ndarray:
    """The sample rows a grammar constrains (StepPlan.bitmask_rows), ascending."""
    return np.array([row for row, seq in enumerate(owners) if seq.grammar is not None], dtype=np.int64)


def fill_masks(owners: list[Sequence], rows: np.ndarray, verify_offsets: list[int] | None = None) -> np.ndarray:
    """The mask of each constrained row (rows: constrained_rows(owners)), [len(rows), words] int32, as the rows'
    matchers stand now: after every token read back so far (the caller settles the step in flight first).
    A verify row after j drafts is masked as the grammar stands after them: the matcher takes each draft before
    the row that follows it (the proposer kept only drafts the grammar allows) and gives them back after the
    sequence's last row. A sequence that ended meanwhile gets a row allowing everything: its sample is dropped."""
    bitmask = np.empty((len(rows), owners[rows[0]].grammar.num_words), dtype=np.int32)
    for index, row in enumerate(rows.tolist()):
        seq = owners[row]
        if seq.is_finished:
            bitmask[index] = -1
            continue
        assert seq.pending_sample_index < 0, "a constrained row's mask needs its previous token"
        offset = verify_offsets[row] if verify_offsets is not None else 0
        if offset:
            allowed = seq.grammar.matcher.accept_token(seq.draft_token_ids[offset - 1])
            assert allowed, "a draft the grammar refuses was proposed"
        seq.grammar.fill(bitmask[index])
        if offset and offset == len(seq.draft_token_ids):
            seq.grammar.matcher.rollback(offset)
    return bitmask


def advance_grammar(scheduler: Scheduler, seq: Sequence, token_id: int, position: int) -> None:
    """seq's matcher takes its token at `position` (not one that ended it by the scheduler's rules: EOS or a stop
    token is no grammar text). A complete output ends the sequence now, with finish_reason "stop", before it samples
    again: a terminated matcher allows only EOS, and nothing at all for a model without EOS. The library may yet
    refuse a token its mask allowed (llguidance gives up on a grammar too complex for its parser's limits, found only
    as it parses): the output cannot go on under its constraint, and ends as "abort"."""
    matcher = seq.grammar.matcher
    if not matcher.accept_token(token_id):
        logger.warning(
            "request %s: its grammar refused token %d, which its mask allowed; the output ends here (abort)",
            seq.request_id, token_id,
        )  # fmt: skip
        if not seq.is_finished or position < seq.num_tokens - 1:
            scheduler.finish(seq, "abort", num_tokens=position + 1)
        return
    if not matcher.is_terminated():
        return
    if seq.is_finished and position == seq.num_tokens - 1:  # at its length limit on the same token: the
        seq.finish_reason = "stop"  # grammar's end names the reason
    else:  # tokens a verify step appended after this one are dropped
        scheduler.finish(seq, "stop", num_tokens=position + 1)


@dataclass(slots=True)
class WaitingRequest:
    seq: Sequence  # sample 0; the others ride in seq.forks until its prompt is computed
    compiled: Future[CompiledGrammar] | None = None  # None until the backend is loaded


@dataclass(slots=True)
class RejectedRequest:
    request_id: str
    error: ValueError  # names the field and what is wrong with it


class GrammarRequests:
    """The requests whose grammar is not ready yet, the backend (loaded on a thread when the first structured request
    comes: it reads the whole vocabulary, ~0.4 s for a 49k-token tokenizer) and its compiler. Called from the
    engine's thread only."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.num_words = bitmask_words(vocab_size)
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar-backend")
        self.backend: Future[StructuredOutputBackend] = loader.submit(
            load_backend, tokenizer, vocab_size, eos_token_ids
        )
        loader.shutdown(wait=False)  # the load runs on; the thread ends with it
        self.compiler: GrammarCompiler | None = None
        self.waiting: dict[str, WaitingRequest] = {}  # in arrival order
        self.rejected: list[RejectedRequest] = []  # every rejection take_finished made, until the engine takes them

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request_id: str, seq: Sequence) -> None:
        """Start compiling seq's constraint. Raises the backend's ValueError at once when it is known to be missing
        (no llguidance: the error names the extra)."""
        if self.backend.done() and self.backend.exception() is not None:
            raise ValueError(str(as_value_error(self.backend.exception())))  # a new one: callers may edit its message
        waiting = WaitingRequest(seq)
        if self.compiler is not None:
            waiting.compiled = self.compiler.submit(seq.sampling_params.structured_outputs)
        self.waiting[request_id] = waiting

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)  # a compile in progress finishes into the cache

    def take_finished(self, timeout: float = 0.0) -> tuple[list[Sequence], list[RejectedRequest]]:
        """The requests whose grammar is ready, in arrival order (each sample now holds its SampleGrammar: schedule
        sample 0), and those whose constraint cannot be compiled (kept in `rejected` too); both leave. With a
        timeout, first wait up to that long for a compile to end (for when nothing else is to be done)."""
        if not self.waiting:
            return [], []
        if timeout:
            pending = [self.backend] if self.compiler is None else [w.compiled for w in self.waiting.values()]
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        if self.compiler is None and not self.start_compiler():
            return [], self.reject_all() if self.backend.done() else []
        ready, rejected = [], []
        for request_id, waiting in list(self.waiting.items()):
            if not waiting.compiled.done():
                continue
            del self.waiting[request_id]
            error = waiting.compiled.exception()
            if error is not None:
                rejected.append(RejectedRequest(request_id, as_value_error(error)))
                continue
            grammar, backend_words = waiting.compiled.result(), self.compiler.backend.bitmask_words
            for sample in (waiting.seq, *waiting.seq.forks):
                stop_token_ids = sample.sampling_params.stop_token_ids
                sample.grammar = SampleGrammar(grammar.matcher(), self.num_words, backend_words, stop_token_ids)
            ready.append(waiting.seq)
        self.rejected += rejected
        return ready, rejected

    def start_compiler(self) -> bool:
        """Once the backend is loaded: the compiler, and a compile for every request waiting. False until then, or
        when the backend failed to load."""
        if not self.backend.done() or self.backend.exception() is not None:
            return False
        self.compiler = GrammarCompiler(self.backend.result())
        for waiting in self.waiting.values():
            waiting.compiled = self.compiler.submit(waiting.seq.sampling_params.structured_outputs)
        return True

    def reject_all(self) -> list[RejectedRequest]:
        error = as_value_error(self.backend.exception())
        rejected = [RejectedRequest(request_id, error) for request_id in self.waiting]
        self.waiting.clear()
        self.rejected += rejected
        return rejected

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()


def as_value_error(error: BaseException) -> ValueError:
    """A constraint the library refuses is the user's to fix, whatever the library raised: a ValueError (an HTTP 400)
    saying what it found."""
    if isinstance(error, ValueError):
        return error
    return ValueError(f"structured_outputs cannot be compiled: {type(error).__name__}: {error}")
