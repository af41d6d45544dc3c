"""llama3_json: Llama 3.1+ JSON calls, the whole output being {"name": ..., "parameters": {...}} (optionally after
<|python_tag|>), several separated by ';'. An output that does not start with '{' is plain content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolParser, call_text
from pagedllm.entrypoints.openai.tool_parsers.json_scan import NotToolCall, scan_call, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def scan(self, text: str, final: bool) -> ParsedTools:
        position = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, position):
            position = skip_whitespace(text, position + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[position:]):  # may still become the tag, or '{'
            return ParsedTools("")
        if position == len(text) or text[position] != "{":
            return ParsedTools(text if final or position < len(text) else "")
        parsed = ParsedTools("")
        while True:
            scan = scan_call(text, position, ("parameters", "arguments"))
            parsed.calls.append(call_text(text, scan))
            if scan.end is None:
                return parsed
            position = skip_whitespace(text, scan.end)
            if position == len(text):
                return parsed
            if text[position] != ";":
                raise NotToolCall("calls must be separated by ';'")
            position = skip_whitespace(text, position + 1)
            if position < len(text) and text[position] != "{":
                raise NotToolCall("';' must be followed by another call")
            if position == len(text):
                return parsed
