"""Scanning JSON text that may still be growing: where a value ends (or that it has not ended yet), and the name and
raw arguments of a tool-call object, so a call can be streamed while the model writes it.

Every scan works on a prefix of the final text: a result for a prefix never contradicts the result for the whole."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


class NotToolCall(ValueError):
    """The text cannot be a tool call in the parser's format."""


WHITESPACE = re.compile(r"[ \t\n\r]*")
STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?\Z")
STRUCTURE = re.compile(r'["{}\[\]]')
LITERAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
PARTIAL_LITERAL = re.compile(r"-?(?:[0-9]+\.?[0-9]*(?:[eE][+-]?[0-9]*)?)?\Z")
CLOSERS = {"{": "}", "[": "]"}


def skip_whitespace(text: str, index: int) -> int:
    return WHITESPACE.match(text, index).end()


def string_end(text: str, index: int) -> int | None:
    """text[index] is '"': the index after the closing quote, or None while the text ends inside the string."""
    end = STRING_BODY.match(text, index + 1).end()
    if end == len(text) or PARTIAL_ESCAPE.match(text, end):
        return None
    if text[end] != '"':
        raise NotToolCall(f"invalid character {text[end]!r} in a JSON string")
    return end + 1


def value_end(text: str, index: int) -> int | None:
    """The index after the JSON value starting at text[index], or None while the text ends inside it. Brackets and
    strings are checked here; json.loads checks the rest once the value is complete."""
    if index >= len(text):
        return None
    first = text[index]
    if first == '"':
        return string_end(text, index)
    if first not in CLOSERS:
        literal = LITERAL.match(text, index)
        if literal is None or literal.end() == len(text):  # a number may still grow
            rest = text[index:]
            if literal is not None or PARTIAL_LITERAL.match(rest) or any(w.startswith(rest) for w in LITERAL_WORDS):
                return None
            raise NotToolCall(f"invalid JSON value starting {rest[:20]!r}")
        return literal.end()
    open_brackets: list[str] = []
    position = index
    while True:
        match = STRUCTURE.search(text, position)
        if match is None:
            return None
        char, position = match.group(), match.start()
        if char == '"':
            end = string_end(text, position)
            if end is None:
                return None
            position = end
            continue
        if char in CLOSERS:
            open_brackets.append(char)
        elif not open_brackets or CLOSERS[open_brackets.pop()] != char:
            raise NotToolCall(f"unbalanced {char!r} in JSON")
        elif not open_brackets:
            return position + 1
        position += 1


LITERAL_WORDS = ("true", "false", "null")


@dataclass(slots=True)
class CallScan:
    """What a tool-call object {"name": ..., "arguments": {...}} shows so far."""

    start: int  # where the object starts in the text
    name: str | None = None  # once its string is complete
    arguments_start: int | None = None  # where the arguments object starts in the text
    arguments_end: int | None = None  # after its closing brace; None while it is being written
    end: int | None = None  # after the call object's closing brace; None while it is open


def scan_call(text: str, index: int, arguments_keys: tuple[str, ...]) -> CallScan:
    """text[index] is '{'. Keys other than "name" and the arguments keys are skipped; the arguments must be an
    object. Raises NotToolCall when the text can no longer be such an object."""
    scan = CallScan(index)
    position = skip_whitespace(text, index + 1)
    if text.startswith("}", position):
        scan.end = position + 1
        return scan
    while position < len(text):
        if text[position] != '"':
            raise NotToolCall("a tool call's keys must be JSON strings")
        key_end = string_end(text, position)
        if key_end is None:
            return scan
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position == len(text):
            return scan
        if text[position] != ":":
            raise NotToolCall("expected ':' after a key")
        position = skip_whitespace(text, position + 1)
        if position == len(text):
            return scan
        end = scan_member(text, position, key, arguments_keys, scan)
        if end is None:
            return scan
        position = skip_whitespace(text, end)
        if position == len(text):
            return scan
        if text[position] == "}":
            scan.end = position + 1
            return scan
        if text[position] != ",":
            raise NotToolCall("expected ',' or '}' after a value")
        position = skip_whitespace(text, position + 1)
    return scan


def scan_member(text: str, position: int, key: str, arguments_keys: tuple[str, ...], scan: CallScan) -> int | None:
    """One value of a call object, recorded in scan when it is the name or the arguments; its end, or None."""
    if key == "name":
        if text[position] != '"':
            raise NotToolCall("a tool call's name must be a string")
        end = string_end(text, position)
        if end is not None:
            scan.name = json.loads(text[position:end])
        return end
    if key in arguments_keys:
        if text[position] != "{":
            raise NotToolCall(f"a tool call's {key} must be a JSON object")
        scan.arguments_start = position
        scan.arguments_end = value_end(text, position)
        return scan.arguments_end
    return value_end(text, position)


def scan_call_array(text: str, index: int, arguments_keys: tuple[str, ...]) -> tuple[list[CallScan], int | None]:
    """text[index] is '[': the call objects of a JSON array so far, and the index after its ']' (None while open)."""
    calls: list[CallScan] = []
    position = skip_whitespace(text, index + 1)
    if text.startswith("]", position):
        return calls, position + 1
    while position < len(text):
        if text[position] != "{":
            raise NotToolCall("a list of tool calls holds JSON objects")
        call = scan_call(text, position, arguments_keys)
        calls.append(call)
        if call.end is None:
            return calls, None
        position = skip_whitespace(text, call.end)
        if position == len(text):
            return calls, None
        if text[position] == "]":
            return calls, position + 1
        if text[position] != ",":
            raise NotToolCall("expected ',' or ']' between tool calls")
        position = skip_whitespace(text, position + 1)
    return calls, None
