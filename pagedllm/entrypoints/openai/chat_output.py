"""How a chat reply's text reads: the thinking first (with --reasoning-parser), then the tool calls in what is left
(the request's ToolRequest), then the content. Whole (`ChatOutput.message`) or streamed (`ChoiceStream`), with the
same result: the streamed deltas concatenate to the whole reply."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningSplit
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer, ToolDeltas, new_call_id


@dataclass(frozen=True, slots=True)
class ChatOutput:
    """One request's reading of its text (every choice reads the same way)."""

    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False  # the output starts inside the thinking
    tools: ToolParser | None = None
    parallel_tool_calls: bool = True

    def split(self, text: str, final: bool) -> ReasoningSplit:
        if self.reasoning is None:
            return ReasoningSplit(None, text)
        return self.reasoning.split(text, self.in_reasoning, final)

    def message(self, text: str) -> AssistantMessage:
        split = self.split(text, final=True)
        message = AssistantMessage(content=split.content, reasoning_content=split.reasoning, reasoning=split.reasoning)
        if self.tools is None:
            return message
        parsed = self.tools.parse(split.content, final=True)
        calls = [] if parsed.failed else parsed.calls[: None if self.parallel_tool_calls else 1]
        if calls:
            message.content = parsed.content or None
            message.tool_calls = [
                ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls
            ]
        return message

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """step(text so far, final) -> the delta since the last step; final once, with the whole text."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.reasoning_sent = 0
        self.content_sent = 0
        self.tools = None if output.tools is None else ToolCallStreamer(output.tools, output.parallel_tool_calls)

    @property
    def made_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.sent_calls

    def step(self, text: str, final: bool) -> DeltaMessage:
        split = self.output.split(text, final)
        reasoning = (split.reasoning or "")[self.reasoning_sent :]
        self.reasoning_sent += len(reasoning)
        if self.tools is None:
            tools = ToolDeltas(split.content[self.content_sent :])
            self.content_sent = len(split.content)
        else:
            tools = self.tools.finish(split.content) if final else self.tools.feed(split.content)
        calls = [
            DeltaToolCall(
                index=call.index,
                id=call.id,
                type="function" if call.id is not None else None,
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in tools.calls
        ]
        return DeltaMessage(
            content=tools.content if tools.content or not (reasoning or calls) else None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=calls or None,
        )


def is_empty(delta: DeltaMessage) -> bool:
    return not (delta.content or delta.reasoning_content or delta.tool_calls)
