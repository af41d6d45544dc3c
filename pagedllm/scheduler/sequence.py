"""One sample of a request: its tokens and progress, as the scheduler and block manager see it."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from pagedllm.sampling.params import SamplingParams

# Stands in token_ids for a token that a step still running on the device has sampled but not yet reported.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


# The members as plain names for the per-step loops: on Python 3.11 `SequenceStatus.FINISHED` is looked up through
# the enum's class at ~80 ns an access, and a decode step of 256 sequences asks about a thousand times.
WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    sample_index: int = 0  # which of the request's n samples this is
    # The request's other samples (n > 1), held by sample 0 until its prompt is computed: they then fork from it,
    # sharing its KV blocks, and each samples its first token from the same logits in that same step.
    forks: list[Sequence] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # Invariant: num_computed_tokens <= num_tokens; tokens below it have their K/V in the cache.
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    # The KV block ids, as int32 (an array, not a list: the plan builder takes every row's bytes in one join).
    block_table: array = field(default_factory=lambda: array("i"))
    num_hashed_blocks: int = 0  # block_table[:num_hashed_blocks] are full, computed and in the prefix cache's index
    # >= 0 while the last token is a PLACEHOLDER: its row among the samples of the step in flight.
    pending_sample_index: int = -1
    # Index of the device-side sampling state (penalty counts, seeded generator), from first admission to the end:
    # 0..max_num_seqs-1, or -1 while it holds none.
    state_index: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    # The length at which it ends (max_tokens output tokens or max_model_len), set by Scheduler.add: both are fixed
    # for its lifetime (the engine's own copy of the SamplingParams is never changed after add_request).
    max_num_tokens: int = 0
    # Structured outputs: this sample's grammar (the engine's engine/grammars.SampleGrammar), set before it is first
    # scheduled; None without a constraint. It stays through preemption, which keeps the tokens and rebuilds only KV.
    grammar: object | None = None
    # Speculative decoding: tokens proposed to follow the last one, which the next step verifies (it computes the
    # last token and these, and samples after each). Set before the step is scheduled, trimmed by the scheduler to
    # what fits, cleared when the step's tokens are appended; a draft model's are PLACEHOLDERs until it fills them,
    # after scheduling. Never part of token_ids: only the accepted ones are appended.
    draft_token_ids: list[int] = field(default_factory=list)
    # The distributions a draft model drew draft_token_ids from (a numpy [drafts, vocab] float32 array: a
    # non-greedy request's), set when it fills them and dropped once they are verified; None: one-hot drafts (the
    # n-gram lookup's, a greedy request's argmax).
    draft_probs: object | None = None
    # This sample's speculation state (the engine's spec_decode.SpeculationState: its acceptance window, back-off).
    speculation: object | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None
