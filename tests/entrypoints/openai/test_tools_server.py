"""Tool calls and reasoning through `pagedllm serve` and the openai SDK, on a tiny Qwen3 with a hermes-style chat
template whose greedy reply to any chat is "<think>a</think>b" (tool_checkpoints.py). The server runs with
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3: forced calls ("required", named) validate
over 200 seeds at temperature 1, calls the model writes (forced here through structured_outputs) are parsed, streamed
deltas reassemble to the whole reply, and the thinking splits off, streamed and not."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Literal

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
    if running.process.poll() is None:  # test_sigint_exits_zero (the last test) normally stopped it already
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


def test_a_reply_with_calls_goes_back_as_it_came(client, server):
    """The SDK's message, dumped as the README shows, is a valid history message (its reasoning too)."""
    first = chat(client, server, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200).choices[0]
    call = first.message.tool_calls[0]
    messages = [*ASK, first.message.model_dump(exclude_none=True)]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    answer = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, temperature=0)
    assert (answer.choices[0].message.reasoning_content, answer.choices[0].message.content) == ("a", "b")


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


# --- /v1/responses --------------------------------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def respond(client, server, **fields):
    return client.responses.create(model=server.model, input="What is the weather in Paris?", **fields)


def items_of(output) -> list[tuple]:
    """Output items without their ids."""
    described = []
    for item in output:
        if item.type == "reasoning":
            described.append(("reasoning", "".join(part.text for part in item.content)))
        elif item.type == "message":
            described.append(("message", "".join(part.text for part in item.content)))
        else:
            described.append(("function_call", item.name, item.arguments, item.call_id.startswith("call_")))
    return described


def collect(events):
    """A streamed response: its events' types, the text each kind of delta adds up to, and the final response."""
    events = list(events)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    deltas: dict[str, str] = {}
    for event in events:
        if event.type.endswith(".delta"):
            deltas[event.type] = deltas.get(event.type, "") + event.delta
    return [event.type for event in events], deltas, events[-1].response


def test_responses_text_whole_and_streamed(client, server):
    whole = respond(client, server, instructions="Be brief.", temperature=0, max_output_tokens=20)
    assert whole.status == "completed" and whole.instructions == "Be brief."
    assert items_of(whole.output) == [("reasoning", "a"), ("message", "b")] and whole.output_text == "b"
    assert whole.usage.output_tokens == 5 and whole.usage.output_tokens_details.reasoning_tokens == 3
    assert whole.usage.total_tokens == whole.usage.input_tokens + 5
    kinds, deltas, final = collect(
        respond(client, server, instructions="Be brief.", temperature=0, max_output_tokens=20, stream=True)
    )
    assert deltas == {"response.reasoning_text.delta": "a", "response.output_text.delta": "b"}
    assert kinds[-1] == "response.completed" and items_of(final.output) == items_of(whole.output)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    with client.responses.stream(model=server.model, input="Hi", temperature=0, max_output_tokens=20) as stream:
        assert stream.get_final_response().output_text == "b"  # the SDK's own accumulation of the events


def test_responses_function_calls_whole_and_streamed(client, server):
    fields = dict(tools=RESPONSE_TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200)
    whole = respond(client, server, temperature=0, **fields)
    (reasoning, (kind, name, arguments, has_call_id)) = items_of(whole.output)
    assert reasoning == ("reasoning", "a") and kind == "function_call" and has_call_id
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    kinds, deltas, final = collect(respond(client, server, temperature=0, stream=True, **fields))
    assert items_of(final.output) == items_of(whole.output)
    assert deltas["response.function_call_arguments.delta"] == arguments
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


def test_responses_named_tool_choice_and_json_text_format(client, server):
    named = respond(
        client, server, tools=RESPONSE_TOOLS, tool_choice={"type": "function", "name": "get_time"}, temperature=0
    )
    assert [item[1] for item in items_of(named.output) if item[0] == "function_call"] == ["get_time"]
    text_format = {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}
    answer = respond(client, server, text={"format": text_format}, temperature=0)
    assert json.loads(answer.output_text) in ("yes", "no") and answer.text.format.type == "json_schema"


def test_responses_cut_by_max_output_tokens_are_incomplete(client, server):
    whole = respond(client, server, temperature=0, max_output_tokens=2)
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    kinds, _, final = collect(respond(client, server, temperature=0, max_output_tokens=2, stream=True))
    assert kinds[-1] == "response.incomplete" and final.status == "incomplete"


def test_responses_input_items_become_the_conversation(client, server):
    """A whole agent turn given back as input: the reasoning, the call and its output reach the chat template."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    reply = client.responses.create(model=server.model, input=items, tools=RESPONSE_TOOLS, temperature=0)
    assert reply.output_text == "b"
    function = {"name": call["name"], "arguments": call["arguments"]}
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "look",
         "tool_calls": [{"id": "call_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    same = client.chat.completions.create(model=server.model, messages=chat_messages, tools=TOOLS, max_tokens=1)
    assert reply.usage.input_tokens == same.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        (dict(previous_response_id="resp_1"), "previous_response_id", "stores no responses"),
        (dict(store=True), "store", "store=false"),
        (dict(include=["message.output_text.logprobs"]), "include", "include is not supported"),
        (dict(reasoning={"effort": "high"}), "reasoning", "reasoning.effort is not supported"),
        (dict(tools=[{"type": "web_search"}]), "tools", "only function tools"),
        (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input", "stores no responses"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input", "only text"),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=RESPONSE_TOOLS, tool_choice={"type": "mcp"}), "tool_choice", "tool_choice is"),
    ],
)
def test_responses_fields_it_cannot_honour_are_400(client, server, fields, param, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": server.model, "input": "Hi", "max_output_tokens": 2, **fields})
    error = caught.value.response.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
    assert respond(client, server, max_output_tokens=2).usage.output_tokens == 2


def test_an_openai_agents_loop_calls_a_tool_and_answers(server):
    """openai-agents against pagedllm serve (its Responses model): the first turn must call the tool (tool_choice
    "required", reset by the agent after the call), the tool's result goes back as input, and the model's reply to
    it (the scripted "b") is the final answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called, sent = [], []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    async def run():
        http_client = httpx.AsyncClient(event_hooks={"request": [record]})
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", http_client=http_client)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=server.model, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?")
        finally:
            await http_client.aclose()

    result = asyncio.run(run())
    assert len(called) == 1 and result.final_output == "b"
    assert [request.get("tool_choice") for request in sent] == ["required", None]
    fed_back = [item for item in sent[1]["input"] if item.get("type") == "function_call_output"]
    assert [item["output"] for item in fed_back] == [f"sunny in {called[0]}"]


# --- last: stops the module's server ---------------------------------------------------------------------------


def test_sigint_exits_zero(server):
    """Ctrl-C (SIGINT) stops the server cleanly with status 0, having logged no traceback during the whole module."""
    assert stop_server(server, signal.SIGINT) == 0, server.log()
    assert "Traceback" not in server.log(), server.log()
