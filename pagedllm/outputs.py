"""What generate() returns, shaped like vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float  # from the model's raw log-softmax: before penalties, temperature and truncation
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's entries: its top-N tokens and always the chosen one (sampled, or the next prompt token).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[PositionLogprobs] | None = None  # one entry per generated token, when logprobs were asked for
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS or length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # One entry per prompt token, None for the first (nothing predicts it), when prompt_logprobs was asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
