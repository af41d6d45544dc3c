"""ToolCallStreamer: a growing output -> what is new since the last look: content, and OpenAI's tool-call deltas (a
call's index, id and name once its name is complete, then fragments of its raw arguments text). Concatenated, the
deltas equal the parse of the whole output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedTools, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    index: int
    arguments: str  # the fragment of the arguments text new in this delta
    id: str | None = None  # with the name, in a call's first delta only
    name: str | None = None


@dataclass(slots=True)
class ToolDeltas:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(slots=True)
class SentCall:
    id: str
    start: int  # where the call's text starts
    arguments: str = ""  # as sent so far


class ToolCallStreamer:
    """feed() the whole text so far at each step, finish() the whole output once. A call is sent once its name is
    complete, its arguments as they grow. Where the whole output is no calls after all (finish's parse failed: a call
    cut off by max_tokens, malformed JSON), the whole reply is its text as content; the stream cannot take back the
    calls it sent, so it ends with them as sent, and with the text from the first call it did not send as content
    (all the text if it sent none: then it equals the whole reply)."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.max_calls = None if parallel else 1
        self.content_sent = 0
        self.sent: list[SentCall] = []
        self.unsent_start: int | None = None  # where the first call not sent yet starts
        self.failed = False

    @property
    def sent_calls(self) -> bool:
        return bool(self.sent)

    def feed(self, text: str) -> ToolDeltas:
        if self.failed:
            return ToolDeltas()
        parsed = self.parser.parse(text, final=False)
        if parsed.failed:
            self.failed = True  # wait for finish(): nothing here is certain any more
            return ToolDeltas()
        return self.deltas(parsed)

    def finish(self, text: str) -> ToolDeltas:
        parsed = self.parser.parse(text, final=True)
        if not parsed.failed:
            return self.deltas(parsed)
        if not self.sent:
            return ToolDeltas(text[self.content_sent :])
        last = self.feed(text)  # the sent calls as far as the text goes
        last.content += text[self.unsent_start :] if self.unsent_start is not None and not self.failed else ""
        return last

    def deltas(self, parsed: ParsedTools) -> ToolDeltas:
        new = ToolDeltas(parsed.content[self.content_sent :])
        self.content_sent = len(parsed.content)
        calls = parsed.calls[: self.max_calls]
        self.unsent_start = None
        for index, call in enumerate(calls):
            if call.name is None:
                self.unsent_start = call.start
                break  # calls go out in order, each once its name is known
            delta = CallDelta(index, "")
            if index == len(self.sent):
                self.sent.append(SentCall(new_call_id(), call.start))
                delta.id, delta.name = self.sent[index].id, call.name
            sent = self.sent[index]
            delta.arguments = call.arguments[len(sent.arguments) :]
            sent.arguments = call.arguments
            if delta.arguments or delta.name is not None:
                new.calls.append(delta)
        return new
