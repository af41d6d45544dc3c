"""Reasoning parsers by vLLM's names (`--reasoning-parser`): the thinking a model writes between <think> and
</think> split from its answer, for the whole output or while it streams; and the grammar that lets a constraint
(response_format, structured_outputs, a forced tool call) apply after the thinking.

deepseek_r1: the output starts in the thinking (its chat template opens <think>; a leading <think> is dropped too);
  text up to </think> is reasoning, the rest content; without </think> everything is reasoning.
qwen3: the output starts in the thinking when it begins with <think>, or when the prompt ends by opening it;
  otherwise (e.g. chat_template_kwargs={"enable_thinking": false}) everything is content.
Whitespace right after </think> is not content."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from pagedllm.structured_output.params import StructuredOutputsParams

START, END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no thinking
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    always_thinks: bool  # deepseek_r1: the output starts in the thinking whatever the prompt
    start_token_id: int
    end_token_id: int

    def starts_in_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the output begins inside the thinking: always for deepseek_r1; for qwen3 when the prompt's last
        tokens open it (a template that adds <think> or <think>\\n to the generation prompt)."""
        if self.always_thinks:
            return True
        tail = prompt_token_ids[-2:]
        return self.start_token_id in tail and self.end_token_id not in tail[tail.index(self.start_token_id) :]

    def split(self, text: str, in_reasoning: bool, final: bool) -> ReasoningSplit:
        """Whole (final) or a prefix of the output; a prefix's split is a prefix of the whole's, field by field."""
        body = len(text) - len(text.lstrip())
        if text.startswith(START, body):
            in_reasoning, body = True, body + len(START)
        elif not final and START.startswith(text[body:]):
            return ReasoningSplit(None, "")  # may still open the thinking
        if not in_reasoning:
            return ReasoningSplit(None, text)
        end = text.find(END, body)
        if end < 0:
            thinking = text[body:]
            return ReasoningSplit(thinking if final else without_partial_marker(thinking, END), "")
        return ReasoningSplit(text[body:end], text[end + len(END) :].lstrip())

    def constraint_after_thinking(
        self, constraint: StructuredOutputsParams, in_reasoning: bool
    ) -> StructuredOutputsParams:
        """The constraint as a Lark grammar whose free thinking comes first: <think> (optional when the output
        starts in the thinking), any text, </think>, up to 4 whitespace characters (bounded, so that no model loops
        on them), then the constraint; for qwen3 outside the thinking the whole block is optional. A grammar of the
        user's own cannot be nested: a 400."""
        think = f"<[{self.start_token_id}]>"
        thinking = f"/(.|\\n)*/ <[{self.end_token_id}]> WS?"
        opening = f"{think}? {thinking}" if in_reasoning else f"({think} {thinking})?"
        return StructuredOutputsParams(
            grammar=f"start: {opening} body\nWS: /[ \\t\\r\\n]{{1,4}}/\nbody: {constraint_rule(constraint)}\n"
        )


def without_partial_marker(text: str, marker: str) -> str:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def constraint_rule(constraint: StructuredOutputsParams) -> str:
    """One constraint as the body of a Lark rule (llguidance's dialect)."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema = dict(constraint.schema())
        if constraint.whitespace_pattern is not None:
            schema["x-guidance"] = {"whitespace_pattern": constraint.whitespace_pattern}
        return f"%json {json.dumps(schema, ensure_ascii=False)}"
    if kind == "regex":
        return f"/{llguidance.regex_to_lark(constraint.regex)}/"
    if kind == "choice":
        return " | ".join(json.dumps(choice, ensure_ascii=False) for choice in constraint.choice)
    raise ValueError(
        "structured_outputs.grammar cannot be used on a server started with --reasoning-parser: the grammar would "
        "have to allow the thinking too; use json, regex or choice, which apply after the thinking"
    )


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> whether the output always starts thinking


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser for this tokenizer, which must hold <think> and </think> as single tokens (the split works on
    the text, the grammar on the token ids)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name} needs the model's tokenizer")
    ids = []
    for marker in (START, END):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"--reasoning-parser {name} needs {marker} as one token of the vocabulary; this "
                f"tokenizer splits it into {len(encoded)}"
            )
        ids.append(encoded[0])
    return ReasoningParser(name, REASONING_PARSERS[name], *ids)
