"""The outputs that tool_choice "required" and a named function force through structured output (their grammars are
in `entrypoints/openai/tools.py`): a JSON list of {"name", "arguments"} objects, or the named function's arguments
object alone."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolCallText, ToolParser, call_text
from pagedllm.entrypoints.openai.tool_parsers.json_scan import NotToolCall, scan_call_array, skip_whitespace, value_end


class RequiredToolCalls(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> ParsedTools:
        position = skip_whitespace(text, 0)
        if position == len(text):
            return ParsedTools("", [ToolCallText(position)])
        if text[position] != "[":
            raise NotToolCall("expected a JSON list of calls")
        scans, _ = scan_call_array(text, position, ("arguments",))
        return ParsedTools("", [call_text(text, scan) for scan in scans])


class NamedToolCall(ToolParser):
    def __init__(self, function_name: str):
        self.name = function_name

    def scan(self, text: str, final: bool) -> ParsedTools:
        position = skip_whitespace(text, 0)
        call = ToolCallText(position, self.name)
        if position < len(text):
            if text[position] != "{":
                raise NotToolCall("expected the arguments' JSON object")
            end = value_end(text, position)
            if end is not None and text[end:].strip():
                raise NotToolCall("text after the arguments' JSON object")
            call.arguments = text[position : end or len(text)]
            call.done = end is not None
        return ParsedTools("", [call])
