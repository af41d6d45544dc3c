"""mistral: [TOOL_CALLS] followed by a JSON list of {"name": ..., "arguments": {...}} (Mistral 7B v0.3, Mistral
Small/Nemo before tokenizer v11); the text before [TOOL_CALLS] is the content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolCallText, ToolParser, call_text, held_back
from pagedllm.entrypoints.openai.tool_parsers.json_scan import NotToolCall, scan_call_array, skip_whitespace

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)

    def scan(self, text: str, final: bool) -> ParsedTools:
        start = text.find(MARKER)
        if start < 0:
            return ParsedTools(text if final else held_back(text, MARKER))
        parsed = ParsedTools(text[:start].rstrip())
        position = skip_whitespace(text, start + len(MARKER))
        if position == len(text):
            parsed.calls.append(ToolCallText(start))
            return parsed
        if text[position] != "[":
            raise NotToolCall(f"{MARKER} is not followed by a JSON list")
        scans, end = scan_call_array(text, position, ("arguments",))
        parsed.calls = [call_text(text, scan) for scan in scans]
        if end is not None and text[end:].strip():
            raise NotToolCall("text after the list of calls")
        return parsed
