"""Tool parsers for tool_choice "auto", by vLLM's names (`--tool-call-parser`): each reads the calls a model writes
in its own format, whole or while it streams (`streaming.py`)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolCallText, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedTools", "ToolCallText", "ToolParser", "tool_parser"]
