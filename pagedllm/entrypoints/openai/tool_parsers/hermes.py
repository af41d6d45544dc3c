"""hermes: calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks among text (Hermes, Qwen2.5,
Qwen3); the text outside the blocks is the content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolCallText, ToolParser, call_text, held_back
from pagedllm.entrypoints.openai.tool_parsers.json_scan import NotToolCall, scan_call, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> ParsedTools:
        content: list[str] = []
        parsed = ParsedTools("")
        position = 0
        while True:
            start = text.find(START, position)
            outside = text[position:] if start < 0 else text[position:start]
            if parsed.calls:
                outside = outside.lstrip()
            if start < 0:
                content.append(outside if final else held_back(outside, START))
                break
            content.append(outside.rstrip())
            position = self.scan_block(text, start, final, parsed)
            if position is None:  # the text ends inside this block
                break
        parsed.content = "".join(content)
        return parsed

    def scan_block(self, text: str, start: int, final: bool, parsed: ParsedTools) -> int | None:
        """One block from its START: its call appended to parsed; the index after it, or None while it is open."""
        body = skip_whitespace(text, start + len(START))
        if body == len(text):
            parsed.calls.append(ToolCallText(start))
            return None
        if text[body] != "{":
            raise NotToolCall(f"{START} is not followed by a JSON object")
        scan = scan_call(text, body, ("arguments",))
        call = call_text(text, scan)
        call.start = start
        parsed.calls.append(call)
        if scan.end is None:
            return None
        after = skip_whitespace(text, scan.end)
        if text.startswith(END, after):
            return after + len(END)
        if final and after == len(text):  # the model stopped right after the JSON
            return after
        if not final and END.startswith(text[after:]):
            return None
        raise NotToolCall(f"text after a call's JSON where {END} belongs")
