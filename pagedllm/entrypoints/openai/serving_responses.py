"""POST /v1/responses, stateless: a Responses request becomes a chat request (its input items as messages, its
function tools as chat tools, text.format as response_format) and runs the chat path; the reply becomes output items
(reasoning, message, function calls), whole or as the Responses stream's events, response.created first and
response.completed (or .incomplete, .failed) last, its output the items the events built."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.chat_output import ChatOutput
from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaMessage,
    DeltaToolCall,
    InvalidRequestError,
)
from pagedllm.entrypoints.openai.responses_protocol import (
    SAMPLING_EXTRAS,
    STATELESS,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseBody,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing, PromptInput, final_outputs
from pagedllm.outputs import CompletionOutput, RequestOutput

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# A response's error when its request ended unfinished: ended by the engine (finish_reason "abort", e.g. a forced output
# its grammar refused), or its stream cut (the server shutting down aborts every request).
ENGINE_ABORTED = "the engine aborted the request before the response finished"
CUT = "the response was cut before it finished: its request was aborted (the server is shutting down)"
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the request, as a chat request ---------------------------------------------------------------------------


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    fields = dict(
        model=request.model,
        messages=chat_messages(request.instructions, request.input),
        tools=chat_tools(request.tools),
        tool_choice=chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        response_format=response_format(request),
        chat_template_kwargs=request.chat_template_kwargs,
        top_k=request.top_k,
        logit_bias=request.logit_bias,
        skip_special_tokens=request.skip_special_tokens,
        **{name: getattr(request, name) for name in SAMPLING_EXTRAS},
    )
    try:
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as error:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"]]
        param = (first.get("ctx") or {}).get("param") or (location[0] if location else None)
        param = RESPONSES_FIELDS.get(param, param)
        raise InvalidRequestError(f"{param}: {'.'.join(location) or 'body'}: {first['msg']}", param) from None


# The chat request's fields that errors may name, as the Responses request calls them; and the phrases of the chat
# path's messages that name them (in this order). The input keeps its chat name in messages: "messages[2]" counts the
# conversation the input became, not the input's items.
RESPONSES_FIELDS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "structured_outputs": "text",
}
RESPONSES_PHRASES = [
    (re.compile(r"\bresponse_format or structured_outputs\b"), "text.format"),
    (re.compile(r"\b(?:response_format\.json_schema\.schema|structured_outputs\.json)\b"), "text.format.schema"),
    (re.compile(r"\b(?:response_format|structured_outputs)\b"), "text.format"),
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
]


def in_responses_terms(error: InvalidRequestError) -> InvalidRequestError:
    """A 400 of the chat path, naming the Responses request's fields instead of the chat request's."""
    message = str(error)
    for phrase, replacement in RESPONSES_PHRASES:
        message = phrase.sub(replacement, message)
    return InvalidRequestError(message, RESPONSES_FIELDS.get(error.param, error.param))


def required(item: dict, key: str, index: int):
    if key not in item:
        raise InvalidRequestError(f"input[{index}] of type {item.get('type', 'message')!r} needs {key!r}", "input")
    return item[key]


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat messages: the model's consecutive items (reasoning, assistant messages, function calls)
    make one assistant message; a function call's output is a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    turn: dict[str, Any] | None = None  # the assistant message the model's items gather into

    def assistant_turn() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = required(item, "role", index)
            if role not in ROLES:
                raise InvalidRequestError(
                    f"input[{index}].role must be one of {', '.join(ROLES)}, got {role!r}", "input"
                )
            text = content_text(required(item, "content", index), index)
            if ROLES[role] == "assistant":
                assistant_turn()["content"] += text
            else:
                turn = None
                messages.append({"role": ROLES[role], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            assistant_turn()["reasoning_content"] = "".join(part.get("text", "") for part in parts)
        elif kind == "function_call":
            call = {"name": required(item, "name", index), "arguments": required(item, "arguments", index)}
            call_id = required(item, "call_id", index)
            assistant_turn().setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": call})
        elif kind == "function_call_output":
            turn = None
            output = content_text(required(item, "output", index), index)
            messages.append({"role": "tool", "tool_call_id": required(item, "call_id", index), "content": output})
        elif kind == "item_reference":
            raise InvalidRequestError(f"input[{index}]: item references need stored items; {STATELESS}", "input")
        else:
            raise InvalidRequestError(
                f"input[{index}]: items of type {kind!r} are not supported; give message, reasoning, function_call "
                "or function_call_output items",
                "input",
            )
    return messages


def content_text(content: str | list, index: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        field = TEXT_PARTS.get(part.get("type"))
        if field is None:
            raise InvalidRequestError(
                f"input[{index}]: only text content is supported, got a part of type {part.get('type')!r}", "input"
            )
        texts.append(part.get(field) or "")
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"tools[{index}]: only function tools are supported, got type {tool.get('type')!r}", "tools"
            )
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice.get("type") == "function" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise InvalidRequestError(
        "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'name': NAME}", "tool_choice"
    )


def response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name or "output", "schema": text_format.json_schema, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": schema}


# --- the reply, as output items -------------------------------------------------------------------------------


def output_items(message: AssistantMessage) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message.reasoning_content)]))
    if message.content or not message.tool_calls:
        items.append(MessageItem(id=item_id("msg"), content=[OutputText(text=message.content or "")]))
    for call in message.tool_calls or []:
        items.append(
            FunctionCallItem(
                id=item_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments
            )
        )
    return items


def finished_status(finish_reason: str | None) -> str:
    if finish_reason in ("stop", "tool_calls"):
        return "completed"
    return "incomplete" if finish_reason == "length" else "failed"


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create_response(self, request: ResponsesRequest) -> ResponseBody | AsyncIterator[str]:
        request.check_supported()
        chat = chat_request(request)
        response_id = item_id("resp")
        try:  # the prompt rendered and tokenized in a worker thread, as for any chat request
            prompt, streams, chat_output = await self.serving.start_chat(chat, response_id)
        except InvalidRequestError as error:
            raise in_responses_terms(error) from None
        body = self.response_body(request, response_id)
        if request.stream:
            return self.response_stream(body, prompt, streams[0], chat_output)
        output = (await final_outputs(streams))[0]
        completion = output.outputs[0]
        items = output_items(chat_output.message(completion.text))
        return self.finish(body, items, prompt, output, completion)

    def response_body(self, request: ResponsesRequest, response_id: str) -> ResponseBody:
        """The response in progress: its request's settings as the Responses API echoes them."""
        tools = [{"strict": None, "description": None, **tool} for tool in request.tools or []]
        text = {"format": {"type": "text"}}
        if request.text is not None and request.text.format is not None:
            text = {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
        return ResponseBody(
            id=response_id,
            model=self.serving.served_model_name,
            status="in_progress",
            instructions=request.instructions,
            metadata=request.metadata,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=request.temperature,
            top_p=request.top_p,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            tools=tools,
            max_output_tokens=request.max_output_tokens,
            text=text,
            user=request.user,
        )

    def finish(
        self,
        body: ResponseBody,
        items: list[OutputItem],
        prompt: PromptInput,
        output: RequestOutput,
        completion: CompletionOutput,
    ) -> ResponseBody:
        body.status = finished_status(completion.finish_reason)
        body.output = items
        if body.status == "incomplete":  # the last item is the one max_output_tokens cut
            body.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            items[-1].status = "incomplete"
        if body.status == "failed":
            body.error = {"code": "server_error", "message": ENGINE_ABORTED}
        body.usage = self.response_usage(items, prompt, output, completion)
        return body

    def response_usage(
        self,
        items: list[OutputItem],
        prompt: PromptInput,
        output: RequestOutput | None,
        completion: CompletionOutput | None,
    ) -> ResponseUsage:
        """Usage of a response, finished or cut (output None: nothing came back yet)."""
        num_input, num_output = len(prompt.token_ids), len(completion.token_ids) if completion is not None else 0
        return ResponseUsage(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens if output else 0),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens(items, completion)),
            total_tokens=num_input + num_output,
        )

    def reasoning_tokens(self, items: list[OutputItem], completion: CompletionOutput | None) -> int:
        """The tokens up to the end of the thinking (all of them when it never ended)."""
        reasoning = self.serving.parsers.reasoning
        if completion is None or reasoning is None or not any(isinstance(item, ReasoningItem) for item in items):
            return 0
        token_ids = list(completion.token_ids)
        end = reasoning.end_token_id
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)

    async def response_stream(
        self, body: ResponseBody, prompt: PromptInput, stream, chat_output: ChatOutput
    ) -> AsyncIterator[str]:
        events = ResponseEvents(body)
        reader = chat_output.stream()
        output = completion = None
        try:
            for event in events.start():
                yield event
            async with aclosing(stream.__aiter__()) as outputs:
                async for output in outputs:
                    completion = output.outputs[0]
                    delta = reader.step(completion.text, completion.finish_reason is not None)
                    for event in events.delta(delta):
                        yield event
            if output is None or completion.finish_reason is None:  # the stream ended early: its request was aborted
                for event in events.fail(self, prompt, output, CUT):
                    yield event
            else:
                for event in events.finish(self, prompt, output, completion):
                    yield event
        except Exception as error:  # the engine stopped
            for event in events.fail(self, prompt, output, f"the engine stopped: {error}"):
                yield event
        finally:
            self.serving.llm.abort(stream.request_id)


class ResponseEvents:
    """The events of one streamed response: each output item is added, grows by deltas, and is done before the
    next one starts; the final response holds the items as they were built."""

    def __init__(self, body: ResponseBody):
        self.body = body
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def event(self, kind: str, **fields) -> str:
        event = StreamEvent(type=kind, sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        return f"event: {kind}\ndata: {event.model_dump_json()}\n\n"

    def start(self) -> list[str]:
        response = self.body.model_dump()
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def delta(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self.reasoning(delta.reasoning_content)
        if delta.content:
            events += self.text(delta.content)
        for call in delta.tool_calls or []:
            events += self.tool_call(call)
        return events

    def add(self, item: OutputItem) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = item
        return [
            *events,
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()),
        ]

    def where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1}

    def reasoning(self, text: str) -> list[str]:
        events = []
        if not isinstance(self.open, ReasoningItem):
            events += self.add(ReasoningItem(id=item_id("rs"), status="in_progress"))
            part = {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", **self.where(), content_index=0, part=part))
            self.open.content.append(ReasoningText(text=""))
        self.open.content[0].text += text
        return [*events, self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=text)]

    def text(self, text: str) -> list[str]:
        events = []
        if not isinstance(self.open, MessageItem):
            events += self.add(MessageItem(id=item_id("msg"), status="in_progress"))
            part = OutputText(text="").model_dump()
            events.append(self.event("response.content_part.added", **self.where(), content_index=0, part=part))
            self.open.content.append(OutputText(text=""))
        self.open.content[0].text += text
        if not text:
            return events
        delta = dict(content_index=0, delta=text, logprobs=[])
        return [*events, self.event("response.output_text.delta", **self.where(), **delta)]

    def tool_call(self, call: DeltaToolCall) -> list[str]:
        events = []
        if call.id is not None:  # a new call
            item = FunctionCallItem(
                id=item_id("fc"), call_id=call.id, name=call.function.name, arguments="", status="in_progress"
            )
            events += self.add(item)
        arguments = call.function.arguments or ""
        if arguments:
            self.open.arguments += arguments
            events.append(self.event("response.function_call_arguments.delta", **self.where(), delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        where = self.where()
        if isinstance(item, ReasoningItem):
            part = item.content[0]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part.model_dump()))
        elif isinstance(item, MessageItem):
            part = item.content[0]
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part.model_dump()))
        else:
            events.append(
                self.event("response.function_call_arguments.done", **where, arguments=item.arguments, name=item.name)
            )
        item.status = status
        self.open = None
        return [
            *events,
            self.event("response.output_item.done", output_index=where["output_index"], item=item.model_dump()),
        ]

    def finish(
        self, serving: OpenAIServingResponses, prompt: PromptInput, output: RequestOutput, completion: CompletionOutput
    ) -> list[str]:
        events = []
        if not self.items:  # an empty reply is an empty message, as the whole reply has
            events += self.text("")
        status = finished_status(completion.finish_reason)
        events += self.close("completed" if status == "completed" else "incomplete")
        body = serving.finish(self.body, self.items, prompt, output, completion)
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            body.status, "response.failed"
        )
        return [*events, self.event(terminal, response=body.model_dump())]

    def fail(
        self, serving: OpenAIServingResponses, prompt: PromptInput, output: RequestOutput | None, message: str
    ) -> list[str]:
        """A response cut before it finished (shutdown, an abort, the engine stopping): the item being built is done
        as incomplete, then response.failed carries the items so far, their usage and the error."""
        events = self.close("incomplete")
        body = self.body
        body.status, body.output = "failed", self.items
        body.error = {"code": "server_error", "message": message}
        completion = output.outputs[0] if output is not None else None
        body.usage = serving.response_usage(self.items, prompt, output, completion)
        return [*events, self.event("response.failed", response=body.model_dump())]
