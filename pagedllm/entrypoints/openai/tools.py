"""A chat request's tools: checked (a 400 naming what is wrong), rendered through the chat template, and turned into
what the output must be. tool_choice "none": no tools shown, text only; "auto": the model may call, read by the
server's --tool-call-parser; "required" and a named function: forced through structured output, as a JSON schema
built from the tools' parameter schemas (below), so the arguments always validate."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from pagedllm.entrypoints.openai.protocol import ChatMessage, ChatTool, InvalidRequestError
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolCall, RequiredToolCalls
from pagedllm.structured_output.params import StructuredOutputsParams

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
COMPACT = " ?"  # the whitespace between the JSON tokens of a forced call
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of one request, checked; mode is "auto", "required" or "named" ("none" asks for no ToolRequest)."""

    tools: list[ChatTool]
    mode: str
    function_name: str | None  # the named function
    parallel: bool  # parallel_tool_calls: more than one call per reply

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template takes them (transformers' format: OpenAI's, as JSON values)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The output forced by "required" (a JSON list of 1 call, or 1 or more with parallel_tool_calls, each
        {"name": one of the tools, "arguments": that tool's parameters}) or by a named function (its arguments object
        alone); None for "auto". The JSON is compact (at most a space between its tokens), so that no model can wander
        into endless whitespace before its call is complete."""
        if self.mode == "named":
            return StructuredOutputsParams(json=parameters_schema(self.named_tool()), whitespace_pattern=COMPACT)
        if self.mode == "required":
            calls = {"anyOf": [call_schema(tool) for tool in self.tools]}
            schema = {"type": "array", "items": calls, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            return StructuredOutputsParams(json=schema, whitespace_pattern=COMPACT)
        return None

    def output_parser(self, auto_parser: ToolParser | None) -> ToolParser:
        if self.mode == "named":
            return NamedToolCall(self.function_name)
        if self.mode == "required":
            return RequiredToolCalls()
        assert auto_parser is not None, "checked in tool_request"
        return auto_parser

    def named_tool(self) -> ChatTool:
        return next(tool for tool in self.tools if tool.function.name == self.function_name)


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    """A function's parameters as a schema of a JSON object (no parameters: the empty object)."""
    parameters = tool.function.parameters
    if parameters is None:
        return NO_PARAMETERS
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def call_schema(tool: ChatTool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters_schema(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_request(
    tools: list[ChatTool] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    auto_parser: ToolParser | None,
) -> ToolRequest | None:
    """The request's tools checked, or None when none apply (no tools, or tool_choice "none")."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            choices = ", ".join(repr(choice) for choice in TOOL_CHOICES)
            raise InvalidRequestError(
                f"tool_choice must be {choices} or {{'type': 'function', 'function': {{'name': ...}}}}, got "
                f"{tool_choice!r}",
                "tool_choice",
            )
        mode, function_name = tool_choice, None
    else:
        mode, function_name = "named", named_function(tool_choice)
    if mode == "none":
        return None
    if not tools:
        if mode == "auto":
            return None
        raise InvalidRequestError(f"tool_choice {mode!r} needs tools", "tool_choice")
    check_tools(tools)
    if function_name is not None and function_name not in {tool.function.name for tool in tools}:
        raise InvalidRequestError(f"tool_choice names {function_name!r}, which is not one of the tools", "tool_choice")
    if mode == "auto" and auto_parser is None:
        raise InvalidRequestError(
            "tool_choice 'auto' (the default when tools are given) needs a server started with "
            "--enable-auto-tool-choice --tool-call-parser NAME; send tool_choice 'required', 'none' or a named "
            "function otherwise",
            "tool_choice",
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    request = ToolRequest(list(tools), mode, function_name, parallel)
    if mode != "auto":
        check_schemas(request)
    return request


def named_function(tool_choice: dict) -> str:
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            "a named tool_choice is {'type': 'function', 'function': {'name': NAME}}", "tool_choice"
        )
    return name


def check_tools(tools: list[ChatTool]) -> None:
    seen = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise InvalidRequestError(
                f"tools[{index}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", "tools"
            )
        if name in seen:
            raise InvalidRequestError(f"tools[{index}].function.name {name!r} is given twice", "tools")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise InvalidRequestError(
                f"tools[{index}].function.parameters must be the JSON schema of an object, got type "
                f"{parameters.get('type')!r}",
                "tools",
            )


def check_schemas(request: ToolRequest) -> None:
    """A forced call's parameter schemas must compile: a 400 naming the tool otherwise."""
    for index, tool in enumerate(request.tools):
        if request.mode == "named" and tool.function.name != request.function_name:
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(parameters_schema(tool))
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise InvalidRequestError(f"tools[{index}].function.parameters: {problem.strip()}", "tools")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: text content, names, assistant tool calls with their arguments
    as JSON values (templates write them with tojson), tool results with their call's id, earlier reasoning."""
    conversation = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [template_call(index, call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        conversation.append(entry)
    return conversation


def template_call(index: int, call) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise InvalidRequestError(
            f"messages[{index}].tool_calls: the arguments of {call.function.name!r} are not valid JSON", "messages"
        ) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
