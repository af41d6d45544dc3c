"""The tool parser interface: a model's output text -> content and tool calls, for the whole text or for a prefix
of it while it streams; and the two formats tool_choice "required" and a named function force (`forced.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.json_scan import CallScan, NotToolCall


@dataclass(slots=True)
class ToolCallText:
    """One call as the text shows it so far."""

    start: int  # where the call's text starts
    name: str | None = None  # once it is complete
    arguments: str = ""  # the raw JSON text of its arguments so far (the model's own bytes)
    done: bool = False  # the call's JSON is complete


@dataclass(slots=True)
class ParsedTools:
    content: str  # text outside the calls; whitespace next to a call is dropped
    calls: list[ToolCallText] = field(default_factory=list)
    failed: bool = False  # the text is not well-formed calls in this format


def call_text(text: str, scan: CallScan) -> ToolCallText:
    call = ToolCallText(scan.start, scan.name, done=scan.end is not None)
    if scan.arguments_start is not None:
        call.arguments = text[scan.arguments_start : scan.arguments_end or len(text)]
    return call


class ToolParser:
    """parse(text, final=True) reads a whole output: calls, or (on any malformed call) the whole text as content.
    parse(text, final=False) reads a prefix: what it returns is a prefix of what a longer text returns (content that
    could still be part of a call is held back), unless it reports failed."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # the text that starts a call; a special token must not be skipped

    def scan(self, text: str, final: bool) -> ParsedTools:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ParsedTools:
        try:
            parsed = self.scan(text, final)
            if final:
                check_complete(parsed.calls)
        except NotToolCall:
            return ParsedTools(text, failed=True)
        return parsed


def check_complete(calls: list[ToolCallText]) -> None:
    """Every call of a whole output is finished, named, and has a JSON object for arguments ({} when it had none)."""
    for call in calls:
        if not call.done or call.name is None:
            raise NotToolCall("an unfinished tool call")
        if not call.arguments:
            call.arguments = "{}"
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            raise NotToolCall("a tool call's arguments are not valid JSON") from None
        if not isinstance(arguments, dict):
            raise NotToolCall("a tool call's arguments must be a JSON object")


def held_back(text: str, marker: str) -> str:
    """text without what may still become a call: a tail that starts the marker, and whitespace before it."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            text = text[:-size]
            break
    return text.rstrip()
