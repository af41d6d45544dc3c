"""The tool parsers (hermes, llama3_json, mistral, and the formats "required" and a named function force) and the
reasoning parsers, on text alone: whole outputs give the calls as written, malformed ones are content, and any
stream of the same text (cut anywhere) reassembles to the whole parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from pagedllm.entrypoints.openai.chat_output import ChatOutput  # noqa: E402
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser  # noqa: E402
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, tool_parser  # noqa: E402
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolCall, RequiredToolCalls  # noqa: E402


def hermes(calls, before="", after="", gap="\n", ensure_ascii=True):
    dump = lambda value: json.dumps(value, ensure_ascii=ensure_ascii)
    blocks = gap.join(f"<tool_call>\n{dump({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    return f"{before}{gap if before else ''}{blocks}{gap if after else ''}{after}"


def streamed(output: ChatOutput, text: str, cuts: list[int]):
    """The deltas of a stream that saw the text grow to each cut, then whole: (reasoning, content, calls)."""
    stream = output.stream()
    reasoning, content, calls = "", "", {}
    for end, final in [(cut, False) for cut in cuts] + [(len(text), True)]:
        delta = stream.step(text[:end], final)
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, (None, ""))
            assert (call.id is not None) == (name is None), "the id and name come once, in the first delta"
            calls[call.index] = (name or call.function.name, arguments + call.function.arguments)
    return reasoning, content, [calls[index] for index in sorted(calls)]


def whole(output: ChatOutput, text: str):
    message = output.message(text)
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    return message.reasoning_content or "", message.content or "", calls


def test_the_parser_names_are_the_flags_choices():
    from pagedllm.entrypoints.openai.cli_args import REASONING_PARSERS as reasoning_flags
    from pagedllm.entrypoints.openai.cli_args import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(reasoning_flags) == set(REASONING_PARSERS)


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n</tool_call>\n'
            '<tool_call>{"arguments": {}, "name": "g"}</tool_call>\n',
            "Let me look.",
            [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")],
        ),
        ("hermes", '<tool_call>{"name": "f"}', "", [("f", "{}")]),  # no arguments, no closing tag: the model stopped
        ("hermes", "no calls <tool", "no calls <tool", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}',
            "",
            [("f", '{"x": "y"}'), ("g", "{}")],
        ),
        ("llama3_json", "  It is {sunny}.", "  It is {sunny}.", []),
        (
            "mistral",
            'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"q": "\\"x\\""}}]',
            "Sure.",
            [("f", '{"q": "\\"x\\""}')],
        ),
    ],
)
def test_whole_outputs(parser, text, content, calls):
    assert whole(ChatOutput(tools=tool_parser(parser)), text) == ("", content, calls)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'a <tool_call>{"name": 1, "arguments": {}}</tool_call>'),
        ("hermes", "<tool_call>[1, 2]</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
        ("llama3_json", '{"answer": 42}'),
        ("mistral", "[TOOL_CALLS] not a list"),
    ],
)
def test_a_malformed_call_leaves_the_whole_text_as_content(parser, text):
    output = ChatOutput(tools=tool_parser(parser))
    assert whole(output, text) == ("", text, [])
    assert streamed(output, text, list(range(len(text)))) == ("", text, [])


@pytest.mark.parametrize(
    ("text", "sent"),
    [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}', ("f", '{"a": 1}')),  # cut off
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ("f", "")),
        ('<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', ("f", '{"a": 1,}')),  # brackets fine, JSON not
        ('<tool_call>{"name": "f"} and more</tool_call>', ("f", "")),
    ],
)
def test_a_call_that_breaks_after_its_name_was_streamed(text, sent):
    """The whole reply is content; a stream cannot take back the deltas it sent, so it ends with them."""
    output = ChatOutput(tools=tool_parser("hermes"))
    assert whole(output, text) == ("", text, [])
    assert streamed(output, text, list(range(len(text)))) == ("", "", [sent])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes([("f", {"a": 1}), ("g", {})])
    output = ChatOutput(tools=tool_parser("hermes"), parallel_tool_calls=False)
    assert whole(output, text) == ("", "", [("f", '{"a": 1}')])
    assert streamed(output, text, list(range(len(text)))) == whole(output, text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "f", "a-b_c"]), arguments), min_size=0, max_size=3)
free_text = st.text(max_size=12).filter(lambda text: "<tool_call>" not in text and "<think>" not in text)


def render(parser: str, call_list, before: str, gap: str, ensure_ascii: bool) -> tuple[str, str]:
    """A model's output in the parser's format and the content it should give."""
    dump = lambda value: json.dumps(value, ensure_ascii=ensure_ascii)
    if parser == "hermes":
        text = hermes(call_list, before, gap=gap, ensure_ascii=ensure_ascii)
        return text, (before.rstrip() if call_list else text)
    if parser == "llama3_json":
        text = gap + ";".join(dump({"name": n, "parameters": a}) for n, a in call_list)
        return text, ("" if call_list else text)
    if parser == "mistral":
        listed = dump([{"name": n, "arguments": a} for n, a in call_list])
        text = f"{before}[TOOL_CALLS]{gap}{listed}" if call_list else before
        return text, (before.rstrip() if call_list else before)
    listed = dump([{"name": n, "arguments": a} for n, a in call_list])  # "required"
    return gap + listed, ""


@settings(max_examples=60, deadline=None)
@given(
    parser=st.sampled_from(["hermes", "llama3_json", "mistral", "required"]),
    call_list=calls,
    before=free_text,
    gap=st.sampled_from(["", "\n", " \n "]),
    ensure_ascii=st.booleans(),
    data=st.data(),
)
def test_any_stream_of_calls_reassembles_to_the_whole_parse(parser, call_list, before, gap, ensure_ascii, data):
    if parser == "llama3_json":
        before = ""
    if parser == "required" and not call_list:
        call_list = [("f", {})]
    text, content = render(parser, call_list, before, gap, ensure_ascii)
    tools = RequiredToolCalls() if parser == "required" else tool_parser(parser)
    output = ChatOutput(tools=tools)
    expected = [(name, json.dumps(args, ensure_ascii=ensure_ascii)) for name, args in call_list]
    assert whole(output, text) == ("", content, expected)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    assert streamed(output, text, cuts) == whole(output, text)


@settings(max_examples=50, deadline=None)
@given(args=arguments, cut=st.integers(0, 200), data=st.data())
def test_a_named_call_streams_its_arguments(args, cut, data):
    text = json.dumps(args)
    output = ChatOutput(tools=NamedToolCall("f"))
    assert whole(output, text) == ("", "", [("f", text)])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    assert streamed(output, text, cuts) == whole(output, text)
    truncated = text[: min(cut, len(text) - 1)]  # a reply cut by max_tokens is no call: its text is the content
    assert whole(output, truncated) == ("", truncated, [])
    # streamed, the call's name went out at the first step, then its arguments as far as they got
    seen = [0] + [cut for cut in cuts if cut <= len(truncated)]
    assert streamed(output, truncated, seen) == ("", "", [("f", truncated)])


def reasoning_output(name: str, prompt_opens: bool, tools=None) -> ChatOutput:
    """As the server reads a reply whose prompt ends with "... <think>\n" (ids 1, 3) or not."""
    reasoning = ReasoningParser(name, REASONING_PARSERS[name], start_token_id=1, end_token_id=2)
    prompt = [5, 1, 3] if prompt_opens else [5, 1, 2, 3]
    return ChatOutput(reasoning, reasoning.starts_in_reasoning(prompt), tools)


@pytest.mark.parametrize(
    ("name", "prompt_opens", "text", "split"),
    [
        ("qwen3", False, "<think>a</think>b", ("a", "b")),
        ("qwen3", False, "<think>\nlong\n</think>\n\nanswer", ("\nlong\n", "answer")),
        ("qwen3", False, "no thinking", ("", "no thinking")),
        ("qwen3", False, "<think>cut off", ("cut off", "")),
        ("qwen3", True, "opened by the prompt</think>b", ("opened by the prompt", "b")),
        ("deepseek_r1", False, "thinks first</think>b", ("thinks first", "b")),
        ("deepseek_r1", False, "<think>a</think>b", ("a", "b")),
        ("deepseek_r1", False, "never closed", ("never closed", "")),
    ],
)
def test_reasoning_split(name, prompt_opens, text, split):
    output = reasoning_output(name, prompt_opens)
    assert whole(output, text)[:2] == split
    assert streamed(output, text, list(range(len(text))))[:2] == split


@settings(max_examples=50, deadline=None)
@given(
    name=st.sampled_from(list(REASONING_PARSERS)),
    prompt_opens=st.booleans(),
    thinking=free_text,
    lead=st.sampled_from(["", "<think>", " <think>"]),
    close=st.booleans(),
    answer=st.one_of(free_text, st.just(hermes([("f", {"a": 1})]))),
    data=st.data(),
)
def test_any_stream_of_thinking_and_calls_reassembles(name, prompt_opens, thinking, lead, close, answer, data):
    text = lead + thinking + ("</think>" + answer if close else "")
    output = reasoning_output(name, prompt_opens, tool_parser("hermes"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    assert streamed(output, text, cuts) == whole(output, text)


def test_the_servers_parser_flags_are_checked():
    from conftest import train_tokenizer
    from tool_checkpoints import tools_tokenizer

    from pagedllm.entrypoints.openai.chat_plan import server_parsers

    with pytest.raises(ValueError, match="go together"):
        server_parsers(None, True, None, tools_tokenizer())
    with pytest.raises(ValueError, match="go together"):
        server_parsers("hermes", False, None, tools_tokenizer())
    with pytest.raises(ValueError, match="<think> as one token"):
        server_parsers(None, False, "qwen3", train_tokenizer())  # no thinking markers in its vocabulary
    parsers = server_parsers("mistral", True, "deepseek_r1", tools_tokenizer())
    assert parsers.tool_parser.name == "mistral" and not parsers.keep_special_tokens  # [TOOL_CALLS] is plain text here
    assert parsers.reasoning.end_token_id == tools_tokenizer().convert_tokens_to_ids("</think>")
