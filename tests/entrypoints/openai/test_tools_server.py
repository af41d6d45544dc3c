"""Tool calls and reasoning through `pagedllm serve` and the openai SDK, on a tiny Qwen3 with a hermes-style chat
template whose greedy reply to any chat is "<think>a</think>b" (tool_checkpoints.py). The server runs with
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3: forced calls ("required", named) validate
over 200 seeds at temperature 1, calls the model writes (forced here through structured_outputs) are parsed, streamed
deltas reassemble to the whole reply, and the thinking splits off, streamed and not."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
pytest.importorskip("llguidance", reason="tool calls need structured outputs")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server_process import start_server, stop_server  # noqa: E402
from tool_checkpoints import TIME, WEATHER, hermes_call, write_tools_model  # noqa: E402

TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> str:
    return write_tools_model(tmp_path_factory.mktemp("scripted_tools"), script="<think>a</think>b")


@pytest.fixture(scope="module")
def server(scripted_dir, tmp_path_factory):
    flags = ["--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    running = start_server(
        scripted_dir, tmp_path_factory.mktemp("tools") / "server.log", *flags, "--reasoning-parser", "qwen3"
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def tokenizer(scripted_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def chat(client, server, **fields):
    return client.chat.completions.create(model=server.model, messages=ASK, **fields)


def forced(text: str) -> dict:
    """extra_body making the model write exactly this text (after its thinking)."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def test_greedy_reply_splits_into_reasoning_and_content(client, server):
    reply = chat(client, server, temperature=0, max_tokens=20)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == ("a", "a", "b")
    assert reply.choices[0].finish_reason == "stop" and message.tool_calls is None
    chunks = list(chat(client, server, temperature=0, max_tokens=20, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.reasoning_content or "" for delta in deltas) == "a"
    assert "".join(delta.content or "" for delta in deltas) == "b"


def test_enable_thinking_false_reaches_the_chat_template(client, server, tokenizer):
    """The template then closes an empty thinking block in the prompt."""
    plain = chat(client, server, max_tokens=1)
    closed = chat(client, server, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    empty_thinking = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert closed.usage.prompt_tokens == plain.usage.prompt_tokens + len(empty_thinking)


@pytest.mark.parametrize(
    ("structured_outputs", "satisfied"),
    [
        ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["n"], "additionalProperties": False},
          "whitespace_pattern": ""}, lambda text: isinstance(json.loads(text)["n"], int)),
    ],
)  # fmt: skip
def test_structured_output_applies_after_the_thinking(client, server, structured_outputs, satisfied):
    reply = chat(client, server, temperature=0, max_tokens=40, extra_body={"structured_outputs": structured_outputs})
    message = reply.choices[0].message
    assert message.reasoning_content == "a"  # the model's own free thinking came first
    assert satisfied(message.content) and reply.choices[0].finish_reason == "stop", message


def test_required_calls_always_validate(client, server):
    """200 seeds (n=200) at temperature 1: one call each, to one of the tools, with valid arguments."""
    reply = chat(
        client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=200, seed=0,
        temperature=1.0, max_tokens=200,
    )  # fmt: skip
    names = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        ((name, arguments),) = calls_of(choice.message)
        jsonschema.validate(arguments, SCHEMAS[name])
        names.add(name)
        assert choice.message.content is None and choice.message.tool_calls[0].id.startswith("call_")
    assert names == set(SCHEMAS), "both tools were chosen by some seed"


def test_named_calls_always_validate(client, server):
    reply = chat(
        client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, n=200,
        seed=1, temperature=1.0, max_tokens=100,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        ((name, arguments),) = calls_of(choice.message)
        assert name == "get_time"
        jsonschema.validate(arguments, SCHEMAS["get_time"])


def test_required_parallel_calls(client, server):
    reply = chat(client, server, tools=TOOLS, tool_choice="required", n=20, seed=2, temperature=1.0, max_tokens=600)
    counts = []
    for choice in reply.choices:
        if choice.finish_reason == "length":
            continue  # a random model may list calls past max_tokens
        calls = calls_of(choice.message)
        counts.append(len(calls))
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
    assert max(counts) >= 2 and len(counts) >= 15, counts


PARALLEL = (
    hermes_call("get_weather", {"city": "Paris", "unit": "celsius"}) + "\n" + hermes_call("get_time", {"zone": "UTC"})
)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_parses_the_calls_the_model_writes(client, server, parallel):
    reply = chat(
        client, server, tools=TOOLS, parallel_tool_calls=parallel, temperature=0, max_tokens=300,
        extra_body=forced("I will look. " + PARALLEL),
    )  # fmt: skip
    choice = reply.choices[0]
    expected = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    assert calls_of(choice.message) == (expected if parallel else expected[:1])
    assert choice.message.content == "I will look." and choice.message.reasoning_content == "a"
    assert choice.finish_reason == "tool_calls"


def reassemble(stream):
    """A streamed chat reply as (reasoning, content, [(name, arguments text)], finish_reason); ids checked."""
    reasoning, content, calls, finish_reason = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("call_") and call.function.name, call
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None, call
                calls[call.index][1] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return reasoning, content, [tuple(calls[index]) for index in sorted(calls)], finish_reason


@pytest.mark.parametrize(
    "fields",
    [
        dict(extra_body=forced("I will look. " + PARALLEL), temperature=0),
        dict(tool_choice="required", seed=3, temperature=1.0),
        dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=4, temperature=1.0),
    ],
)
def test_streamed_deltas_reassemble_to_the_whole_reply(client, server, fields):
    whole = chat(client, server, tools=TOOLS, max_tokens=300, **fields).choices[0]
    streamed = reassemble(chat(client, server, tools=TOOLS, max_tokens=300, stream=True, **fields))
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    assert streamed == (whole.message.reasoning_content, whole.message.content or "", calls, whole.finish_reason)
    assert calls


def test_a_malformed_call_is_returned_as_content(client, server):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'
    reply = chat(client, server, tools=TOOLS, temperature=0, max_tokens=100, extra_body=forced(broken))
    choice = reply.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (broken, None, "stop")


def test_a_conversation_with_calls_and_results_renders(client, server, tokenizer):
    """The assistant's calls and the tool's result reach the template (its hermes blocks and <tool_response>)."""
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = tokenizer.decode(tokens)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    reply = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, temperature=0)
    assert reply.choices[0].message.content == "b"


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
        (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "named tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools", "given twice"),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools", "letters, digits"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "tools",
         "schema of an object"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
         "properties": {"a": {"type": "nope"}}}}}], tool_choice="required"), "tools", "tools[0].function.parameters"),
        (dict(tools=[{"type": "web_search"}]), "tools", "function"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
         "forces the output"),
        (dict(extra_body={"structured_outputs": {"grammar": 'start: "x"'}}), "structured_outputs", "reasoning-parser"),
        (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
         "function": {"name": "f", "arguments": "{not json"}}]}]), "messages", "not valid JSON"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_and_the_server_serves_on(client, server, fields, param, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": server.model, "messages": ASK, "max_tokens": 2, **fields})
    error = caught.value.response.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
    assert chat(client, server, max_tokens=2).usage.completion_tokens == 2
