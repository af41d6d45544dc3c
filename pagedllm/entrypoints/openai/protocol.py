"""The OpenAI API's request and response bodies (with vLLM's extra sampling fields), as pydantic models, and the one
place where a request becomes SamplingParams."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request parameter the server cannot honour: answered as a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI does


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """Every request field -> its SamplingParams field (None: SamplingParams' default); a value SamplingParams
        refuses is a 400 with its message."""
        try:
            logit_bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
        requested: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias,
        )
        try:
            return SamplingParams(**{name: value for name, value in requested.items() if value is not None})
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(str(error)) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise InvalidRequestError(f"only text content parts are supported, got {sorted(kinds)}", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# --- responses ------------------------------------------------------------------------------------------------


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
