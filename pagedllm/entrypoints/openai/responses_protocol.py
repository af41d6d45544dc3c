"""The Responses API's request and response bodies (POST /v1/responses), as pydantic models: the fields this
stateless server honours, and the output items and stream events it sends, shaped as the openai SDK parses them."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import (
    COMMON_UNSUPPORTED,
    NEUTRAL_VALUES,
    InvalidRequestError,
    OpenAIBaseModel,
    RequestModel,
    unsupported,
)

STATELESS = "this server stores no responses or conversations; send the whole conversation as input"

# Fields this server does not honour; any value but a neutral one is a 400 naming the field. (service_tier and the
# prompt cache's options are accepted and change nothing, as in chat: there is one tier, and the cache is automatic.)
RESPONSES_UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "previous_response_id": unsupported(STATELESS),
    "conversation": unsupported(STATELESS),
    "prompt": unsupported("stored prompt templates are not kept; send instructions and input"),
    "store": unsupported(STATELESS + " (send store=false)", (None, False)),
    "background": unsupported("responses run in the foreground; stream them instead", (None, False)),
    "background_options": unsupported(
        "responses run in the foreground; stream them instead", (*NEUTRAL_VALUES, {"completion_window": "soonest"})
    ),
    "include": unsupported("there is nothing extra to include (no logprobs, no encrypted reasoning)"),
    "truncation": unsupported("input is never truncated; shorten it", (None, "disabled")),
    "top_logprobs": unsupported("logprobs are not returned by /v1/responses", (None, 0)),
    "max_tool_calls": unsupported("there are no built-in tools to limit"),
    "context_management": unsupported("the context is never compacted"),
    "moderation": unsupported("there is no moderation"),
    "access_programs": unsupported("there are no access programs", (*NEUTRAL_VALUES, {"cyber": "standard"})),
    "image": unsupported("the input is text only", (*NEUTRAL_VALUES, {"context_compression": "auto"})),
    # vLLM's extras
    "request_id": unsupported("the server names each response itself"),
    "priority": COMMON_UNSUPPORTED["priority"],
    "cache_salt": COMMON_UNSUPPORTED["cache_salt"],
    "mm_processor_kwargs": unsupported("the input is text only"),
    "enable_response_messages": unsupported("the output is items only, never raw messages"),
    "previous_input_messages": unsupported(STATELESS),
    # The chat and completions names of what a response takes otherwise, or not at all
    "messages": unsupported("a response's conversation is its input (and instructions)"),
    "max_tokens": unsupported("use max_output_tokens"),
    "max_completion_tokens": unsupported("use max_output_tokens"),
    "response_format": unsupported("use text.format"),
    "structured_outputs": unsupported("use text.format"),
    "n": unsupported("a response has one output; send one request per sample", (None, 1)),
    "logprobs": unsupported("logprobs are not returned by /v1/responses", (None, False, 0)),
    "prompt_logprobs": unsupported("logprobs are not returned by /v1/responses", (None, 0)),
    "echo": unsupported("a response never repeats its input", (None, False)),
    "best_of": unsupported("a response has one output", (None, 1)),
    "suffix": unsupported("there is no insertion mode; the input is the whole prompt"),
}
# vLLM's sampling extras a response takes as chat does (serving_responses.chat_request hands them on)
SAMPLING_EXTRAS = (
    "frequency_penalty", "presence_penalty", "seed", "stop", "min_p", "repetition_penalty", "min_tokens",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
)  # fmt: skip


class ReasoningConfig(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None

    def check_supported(self) -> None:
        given = {**(self.model_extra or {}), "effort": self.effort, "summary": self.summary}
        for name, value in given.items():
            if value not in NEUTRAL_VALUES:
                raise InvalidRequestError(
                    f"reasoning.{name} is not supported: the model thinks as its chat template and "
                    "chat_template_kwargs say, and its thinking comes back whole as a reasoning item",
                    "reasoning",
                )


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one there is: others are a 400 from validation


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, but check_supported sees these
    unsupported_fields: ClassVar[dict[str, tuple[str, tuple]]] = RESPONSES_UNSUPPORTED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: there is no obfuscation to include
    metadata: dict[str, str] | None = None  # returned with the response
    # Identifiers OpenAI uses for abuse monitoring and cache routing; one server needs neither.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float | None = None  # SAMPLING_EXTRAS: None leaves chat's default
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None

    def check_supported(self) -> None:
        for name, (why, neutral) in self.unsupported_fields.items():
            value = (self.model_extra or {}).get(name)
            if value not in neutral:
                raise InvalidRequestError(f"{name} is not supported: {why}", name)
        if self.reasoning is not None:
            self.reasoning.check_supported()


# --- the response ---------------------------------------------------------------------------------------------


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseBody(OpenAIBaseModel):
    """The Response object (named so as not to clash with HTTP responses)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    max_output_tokens: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    previous_response_id: None = None
    user: str | None = None


class StreamEvent(BaseModel):
    """One server-sent event of a streamed response; the fields besides type and sequence_number vary by type."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
