"""What a chat request asks beyond plain text, decided before it runs: its tools (checked), what the chat template
gets, the constraint on its output (a forced tool call or its own response_format, after the thinking when the
server has a reasoning parser), and how its output reads (a ChatOutput)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.chat_output import ChatOutput
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, InvalidRequestError
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, tool_parser
from pagedllm.entrypoints.openai.tools import ToolRequest, tool_request
from pagedllm.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class ServerParsers:
    """The server's --tool-call-parser (with --enable-auto-tool-choice) and --reasoning-parser."""

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    keep_special_tokens: bool = False  # the tool parser's markers are special tokens: decode them into the text


def server_parsers(
    tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning: str | None, tokenizer
) -> ServerParsers:
    """ValueError for a flag without its partner, an unknown name, or a tokenizer the reasoning parser cannot use."""
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser NAME go together: give both or neither")
    parser = tool_parser(tool_call_parser) if tool_call_parser else None
    special = set(tokenizer.all_special_tokens) if tokenizer is not None else set()
    return ServerParsers(
        tool_parser=parser,
        reasoning=reasoning_parser(reasoning, tokenizer) if reasoning else None,
        keep_special_tokens=parser is not None and any(marker in special for marker in parser.markers),
    )


@dataclass(frozen=True, slots=True)
class ChatPlan:
    tools: ToolRequest | None
    parsers: ServerParsers

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The request's chat_template_kwargs, with the tools when the model may call them."""
        if self.tools is None:
            return dict(kwargs or {})
        return {**(kwargs or {}), "tools": self.tools.template_tools()}

    def apply(self, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """The constraint a forced call puts on the output (instead of the request's own, which it cannot be given
        with), moved after the thinking; special tokens kept in the text when the tool parser reads them."""
        forced = self.tools.constraint() if self.tools is not None else None
        if forced is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError(
                    f"tool_choice {self.tool_choice_name()} forces the output's format: send no response_format "
                    "or structured_outputs with it",
                    "tool_choice",
                )
            params.structured_outputs = forced
        reasoning = self.parsers.reasoning
        if reasoning is not None and params.structured_outputs is not None:
            in_reasoning = reasoning.starts_in_reasoning(prompt_token_ids)
            try:
                params.structured_outputs = reasoning.constraint_after_thinking(params.structured_outputs, in_reasoning)
            except ValueError as error:
                raise InvalidRequestError(str(error), "structured_outputs") from None
        if self.tools is not None and self.tools.mode == "auto" and self.parsers.keep_special_tokens:
            params.skip_special_tokens = False

    def tool_choice_name(self) -> str:
        return repr(self.tools.mode) if self.tools.mode != "named" else f"naming {self.tools.function_name!r}"

    def output(self, prompt_token_ids: list[int]) -> ChatOutput:
        reasoning = self.parsers.reasoning
        tools = self.tools
        return ChatOutput(
            reasoning=reasoning,
            in_reasoning=reasoning is not None and reasoning.starts_in_reasoning(prompt_token_ids),
            tools=tools.output_parser(self.parsers.tool_parser) if tools is not None else None,
            parallel_tool_calls=tools.parallel if tools is not None else True,
        )


def plan_chat(request: ChatCompletionRequest, parsers: ServerParsers) -> ChatPlan:
    tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls, parsers.tool_parser)
    return ChatPlan(tools, parsers)
