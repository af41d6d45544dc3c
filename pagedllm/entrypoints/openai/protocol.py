"""The OpenAI API's request and response bodies (with vLLM's extra sampling fields), as pydantic models, and the one
place where a request becomes SamplingParams."""

from __future__ import annotations

import re
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.sampling.params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request parameter the server cannot honour: answered as a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI does


# Integers a request can hold: what travels to the engine core (msgpack's 64 bits); each field narrows it further.
MIN_REQUEST_INT, MAX_REQUEST_INT = -(2**63), 2**64 - 1


def check_request_values(value: Any, path: str, param: str) -> None:
    """Anywhere in a request body, every integer fits in 64 bits and every string is Unicode text (no lone
    surrogate); otherwise an InvalidRequestError naming the top-level field (`param`) and the place (`path`)."""
    if isinstance(value, str):
        check_request_text(value, path, param)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not MIN_REQUEST_INT <= value <= MAX_REQUEST_INT:
            digits = str(value)
            shown = digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits.lstrip('-'))} digits)"
            raise InvalidRequestError(
                f"{path} is {shown}, which is out of range: an integer in a request must be within "
                "[-2**63, 2**64 - 1], and within that the field's own range",
                param,
            )
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_request_values(item, f"{path}[{index}]", param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_request_values(key, f"{path} (a key)", param)
            check_request_values(item, f"{path}.{key}", param)


def check_request_text(text: str, path: str, param: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise InvalidRequestError(
            f"{path} holds a lone surrogate U+{code:04X} at character {error.start}: half of a UTF-16 pair, which is "
            "not a character on its own; send valid Unicode text (in JSON, an escape \\ud800-\\udbff must be "
            "followed by one \\udc00-\\udfff)",
            param,
        ) from None


class RequestModel(OpenAIBaseModel):
    """A request body: its values are checked (check_request_values) before any field is parsed, so no value the
    engine core cannot take gets past the server (a 400 naming the field instead of a 500)."""

    @model_validator(mode="before")
    @classmethod
    def check_values(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                try:
                    check_request_values(value, str(name), str(name))
                    continue
                except RecursionError:
                    error = InvalidRequestError(f"{name} is nested too deeply", str(name))
                except InvalidRequestError as refused:
                    error = refused
                # pydantic reports it as a validation error, which the server answers with a 400 naming error.param
                raise PydanticCustomError("invalid_value", "{message}", {"message": str(error), "param": error.param})
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always followed exactly


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's structured_outputs keys that StructuredOutputsParams lacks, with the values that ask for nothing different
# (one backend, so there is never a fallback to disable).
NEUTRAL_STRUCTURED_OUTPUTS_OPTIONS = {
    "disable_fallback": (True, False),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
}
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern")


def structured_outputs_params(
    response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """The constraint of OpenAI's response_format or of vLLM's structured_outputs (at most one of them); None for
    plain text. A bad value is a 400 naming the field."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and structured_outputs is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both", "structured_outputs")
    if wants_format:
        return response_format_params(response_format)
    if structured_outputs is None:
        return None
    fields = {}
    for key, value in structured_outputs.items():
        if value is None or value in NEUTRAL_STRUCTURED_OUTPUTS_OPTIONS.get(key, ()):
            continue
        if key not in STRUCTURED_OUTPUTS_KEYS:
            allowed = ", ".join(STRUCTURED_OUTPUTS_KEYS)
            raise InvalidRequestError(
                f"structured_outputs.{key} is not supported; structured_outputs takes {allowed}", "structured_outputs"
            )
        fields[key] = value
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(str(error), "structured_outputs") from None


def response_format_params(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs json_schema: {name, schema}", "response_format"
        )
    try:
        return StructuredOutputsParams(json=json_schema.json_schema)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(f"response_format.json_schema.schema: {error}", "response_format") from None


# Fields of OpenAI's or vLLM's API that this server does not honour. They are not declared, so they land in
# model_extra; any value but a neutral one (by default null, false, 0 or empty) is a 400 naming the field.
NEUTRAL_VALUES = (None, False, "", [], {})


def unsupported(why: str, neutral: tuple = NEUTRAL_VALUES) -> tuple[str, tuple]:
    return why, neutral


COMMON_UNSUPPORTED: dict[str, tuple[str, tuple]] = {  # name -> (why, the values that ask for nothing)
    "use_beam_search": unsupported("beam search is not implemented"),
    "allowed_token_ids": unsupported("restricting the vocabulary is not implemented"),
    "bad_words": unsupported("bad words are not implemented"),
    "truncate_prompt_tokens": unsupported("prompts are never truncated; shorten the prompt"),
    "logits_processors": unsupported("custom logits processors are not implemented"),
    "priority": unsupported("requests are scheduled first come, first served"),
    "return_tokens_as_token_ids": unsupported("tokens are returned as text"),
    "return_token_ids": unsupported("token ids are not returned"),
    "cache_salt": unsupported("the prefix cache is shared by every request"),
    "kv_transfer_params": unsupported("disaggregated prefill is not implemented"),
    "vllm_xargs": unsupported("there are no extra arguments to pass"),
    "guided_json": unsupported("use structured_outputs (vLLM 0.12's name) or response_format"),
    "guided_regex": unsupported("use structured_outputs (vLLM 0.12's name)"),
    "guided_choice": unsupported("use structured_outputs (vLLM 0.12's name)"),
    "guided_grammar": unsupported("use structured_outputs (vLLM 0.12's name)"),
    "guided_decoding_backend": unsupported("use structured_outputs (vLLM 0.12's name)"),
    "guided_whitespace_pattern": unsupported("use structured_outputs (vLLM 0.12's name)"),
    "structural_tag": unsupported("structural tags are not implemented"),
}


class SamplingRequest(RequestModel):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="allow")  # unknown fields are still ignored, but check_supported sees them
    unsupported_fields: ClassVar[dict[str, tuple[str, tuple]]] = COMMON_UNSUPPORTED

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
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields

    def check_supported(self) -> None:
        """A 400 naming the first field sent that this server would otherwise ignore."""
        for name, (why, neutral) in self.unsupported_fields.items():
            value = (self.model_extra or {}).get(name)
            if value not in neutral:
                raise InvalidRequestError(f"{name} is not supported: {why}", name)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """Every request field -> its SamplingParams field (None: SamplingParams' default); a value SamplingParams
        refuses is a 400 with its message."""
        logit_bias = {}
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if re.fullmatch(r"-?[0-9]{1,20}", key.strip()) else None
            if token is None or not 0 <= token <= MAX_REQUEST_INT:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0 written as strings), got {key[:40]!r}",
                    "logit_bias",
                )
            logit_bias[token] = bias
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
            structured_outputs=structured_outputs_params(self.response_format, self.structured_outputs),
        )
        try:
            return SamplingParams(**{name: value for name, value in requested.items() if value is not None})
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(str(error), self.field_named_in(str(error))) from None

    def field_named_in(self, message: str) -> str | None:
        """The first of this request's fields that SamplingParams' message names (its messages start with the
        field: "n must be ...", "each of stop_token_ids ...")."""
        found = [
            (match.start(), name) for name in type(self).model_fields if (match := re.search(rf"\b{name}\b", message))
        ]
        return min(found)[1] if found else None


class CompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, tuple[str, tuple]]] = COMMON_UNSUPPORTED | {
        "best_of": unsupported("each choice is sampled on its own; use n", (None, 1)),
        "add_special_tokens": unsupported(
            "the tokenizer's special tokens are always added to a text prompt", (None, True)
        ),
        "prompt_embeds": unsupported("prompts are text or token ids"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None  # forced calls always follow the schema; "auto" calls are the model's own


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # handed to the chat template, as vLLM does
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    reasoning_content: str | None = None  # an assistant's earlier thinking (vLLM's name; `reasoning` too)
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise InvalidRequestError(f"only text content parts are supported, got {sorted(kinds)}", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, tuple[str, tuple]]] = COMMON_UNSUPPORTED | {
        "functions": unsupported("the deprecated functions API is not implemented; use tools"),
        "function_call": unsupported(
            "the deprecated functions API is not implemented; use tool_choice", (None, "none", "auto")
        ),
        "audio": unsupported("the output is text only"),
        "modalities": unsupported("the output is text only", (None, ["text"])),
        "web_search_options": unsupported("there is no web search"),
        "reasoning_effort": unsupported("this server's models take no reasoning effort"),
        "verbosity": unsupported("this server's models take no verbosity"),
        "prompt_logprobs": unsupported("use /v1/completions for prompt logprobs"),
        "echo": unsupported("use /v1/completions to echo the prompt"),
        "documents": unsupported("documents are not passed to the chat template"),
        "chat_template": unsupported("the model's own chat template is used"),
        "mm_processor_kwargs": unsupported("the input is text only"),
        "add_special_tokens": unsupported("the chat template alone places special tokens"),
        "moderation": unsupported("no moderation is run on the input or the output"),
        "store": unsupported("completions are not stored", (None, False)),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # checked, with tool_choice, in tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# --- responses ------------------------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed again)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking (vLLM's older name)
    reasoning: str | None = None  # the same (vLLM's newer name)
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None  # with the name, in a call's first delta
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
