"""The server's request bodies (completions, chat and responses), in one process (the app under Starlette's
TestClient, AsyncLLM's core in a thread): every field a request may carry is honoured or refused with a 400 naming it;
values the engine core cannot take (integers past 64 bits, lone surrogates) are 400s that leave nothing behind; errors
speak in the request's terms."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import threading
import typing
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
openai = pytest.importorskip("openai")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402
from openai.types.responses import response_create_params  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from server_process import write_chat_model  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.async_engine import AsyncLLM  # noqa: E402
from pagedllm.entrypoints.openai.metrics import ServerMetrics  # noqa: E402
from pagedllm.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequestError,
)
from pagedllm.entrypoints.openai.responses_protocol import SAMPLING_EXTRAS, ResponsesRequest  # noqa: E402
from pagedllm.entrypoints.openai.serving import OpenAIServing  # noqa: E402
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, chat_request  # noqa: E402

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "The quick brown"}]
HERE = Path(__file__).parent

# Every field of each endpoint's request that the server honours, and the test that shows it (a test of this
# directory, "file::function", whose code names the field). Add a field here when it is implemented; a field that
# is neither here nor in NO_EFFECT must be a 400 naming it (test_every_other_field_is_a_400_naming_it).
SAMPLING_TEST = "test_request_fields.py::test_sampling_fields_reach_sampling_params"
RESPONSES_TEST = "test_request_fields.py::test_responses_fields_reach_the_chat_request"
COMMON_IMPLEMENTED = {
    "model": "test_server.py::test_errors_then_a_good_request",
    "frequency_penalty": SAMPLING_TEST,
    "presence_penalty": SAMPLING_TEST,
    "logit_bias": SAMPLING_TEST,
    "n": "test_server.py::test_n_2",
    "seed": SAMPLING_TEST,
    "stop": "test_server.py::test_stop_strings",
    "stream": "test_server.py::test_completion_streamed_equals_whole",
    "stream_options": "test_server.py::test_completion_streamed_equals_whole",
    "temperature": SAMPLING_TEST,
    "top_p": SAMPLING_TEST,
    "top_k": SAMPLING_TEST,
    "min_p": SAMPLING_TEST,
    "repetition_penalty": SAMPLING_TEST,
    "min_tokens": SAMPLING_TEST,
    "ignore_eos": SAMPLING_TEST,
    "stop_token_ids": SAMPLING_TEST,
    "include_stop_str_in_output": SAMPLING_TEST,
    "skip_special_tokens": SAMPLING_TEST,
    "response_format": "test_server.py::test_structured_outputs_constrain_chat_and_completions",
    "structured_outputs": "test_server.py::test_structured_outputs_constrain_chat_and_completions",
}
IMPLEMENTED = {
    "completions": COMMON_IMPLEMENTED
    | {
        "prompt": "test_server.py::test_token_id_prompts",
        "max_tokens": "test_server.py::test_max_tokens_gives_exactly_that_many_tokens",
        "echo": "test_server.py::test_echo_with_logprobs_equals_transformers",
        "logprobs": "test_server.py::test_echo_with_logprobs_equals_transformers",
        "prompt_logprobs": SAMPLING_TEST,
    },
    "chat": COMMON_IMPLEMENTED
    | {
        "messages": "test_server.py::test_chat_streamed_and_not",
        "max_tokens": "test_server.py::test_chat_logprobs_leave_out_the_stop_token",
        "max_completion_tokens": "test_server.py::test_chat_streamed_and_not",
        "logprobs": "test_server.py::test_chat_logprobs",
        "top_logprobs": "test_server.py::test_chat_logprobs",
        "add_generation_prompt": "test_request_fields.py::test_chat_fields_reach_the_chat_template",
        "continue_final_message": "test_request_fields.py::test_chat_fields_reach_the_chat_template",
        "chat_template_kwargs": "test_request_fields.py::test_chat_fields_reach_the_chat_template",
        "tools": "test_tools_server.py::test_required_calls_always_validate",
        "tool_choice": "test_tools_server.py::test_named_calls_always_validate",
        "parallel_tool_calls": "test_tools_server.py::test_auto_parses_the_calls_the_model_writes",
    },
    # /v1/responses runs as a chat request: the fields that become chat fields are checked where they land
    # (RESPONSES_TEST), what they do end to end in test_tools_server.py.
    "responses": {
        "model": "test_request_fields.py::test_responses_model_metadata_and_user",
        "input": "test_tools_server.py::test_responses_input_items_become_the_conversation",
        "instructions": "test_tools_server.py::test_responses_text_whole_and_streamed",
        "stream": "test_tools_server.py::test_responses_text_whole_and_streamed",
        "tools": "test_tools_server.py::test_responses_function_calls_whole_and_streamed",
        "tool_choice": "test_tools_server.py::test_responses_named_tool_choice_and_json_text_format",
        "text": "test_tools_server.py::test_responses_named_tool_choice_and_json_text_format",
        "max_output_tokens": "test_tools_server.py::test_responses_cut_by_max_output_tokens_are_incomplete",
        "metadata": "test_request_fields.py::test_responses_model_metadata_and_user",
        "parallel_tool_calls": RESPONSES_TEST,
        "temperature": RESPONSES_TEST,
        "top_p": RESPONSES_TEST,
        "top_k": RESPONSES_TEST,
        "logit_bias": RESPONSES_TEST,
        "skip_special_tokens": RESPONSES_TEST,
        "chat_template_kwargs": RESPONSES_TEST,
        **{name: RESPONSES_TEST for name in SAMPLING_EXTRAS},
    },
}
# Fields accepted that, by what they mean, change nothing in the output here; each with the reason.
COMMON_NO_EFFECT = {
    "user": "an end-user id for the provider's abuse monitoring; it never changes the output",
    "spaces_between_special_tokens": "fast tokenizers never put spaces between special tokens; false asks for that",
}
NO_EFFECT = {
    "completions": COMMON_NO_EFFECT,
    "chat": COMMON_NO_EFFECT
    | {
        "metadata": "tags for stored completions; nothing is stored",
        "prediction": "a predicted output only makes OpenAI faster; the output is the same",
        "prompt_cache_key": "the prefix cache is automatic and shared; a cache key only routes requests",
        "prompt_cache_options": "the prefix cache is automatic and shared",
        "prompt_cache_retention": "the prefix cache is automatic and shared",
        "safety_identifier": "an end-user id for the provider's abuse monitoring; it never changes the output",
        "service_tier": "there is one tier",
    },
    "responses": {
        "user": COMMON_NO_EFFECT["user"],
        "safety_identifier": "an end-user id for the provider's abuse monitoring; it never changes the output",
        "prompt_cache_key": "the prefix cache is automatic and shared; a cache key only routes requests",
        "prompt_cache_options": "the prefix cache is automatic and shared",
        "prompt_cache_retention": "the prefix cache is automatic and shared",
        "service_tier": "there is one tier",
        "stream_options": "include_obfuscation pads stream events against length side channels; none are padded, "
        "and the events say the same",
    },
}
NO_EFFECT_EXAMPLES = {
    "user": "alice",
    "spaces_between_special_tokens": False,
    "metadata": {"run": "1"},
    "prediction": {"type": "content", "content": "The quick brown fox"},
    "prompt_cache_key": "key",
    "prompt_cache_options": {"ttl": "5m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-1",
    "service_tier": "flex",
    "stream_options": {"include_obfuscation": True},
}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest, "responses": ResponsesRequest}
SDK_PARAMS = {  # the fields the official SDK may send (it sends `stream` through its overloads)
    "completions": typing.get_type_hints(completion_create_params.CompletionCreateParamsBase),
    "chat": typing.get_type_hints(chat_create_params.CompletionCreateParamsBase),
    "responses": typing.get_type_hints(response_create_params.ResponseCreateParamsBase),
}
BASES = {  # the smallest body of each endpoint
    "completions": dict(prompt="Paris", max_tokens=3),
    "chat": dict(messages=USER, max_tokens=3),
    "responses": dict(input="The quick brown", max_output_tokens=3),
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


@pytest.fixture(scope="session")
def chat_model_dir(llama_dir, tmp_path_factory) -> str:
    return write_chat_model(llama_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def app_server(chat_model_dir):
    """The server's app over a tiny chat model; yields (llm, an openai client, the raw test client)."""
    llm = AsyncLLM(chat_model_dir, max_model_len=512, core_in_thread=True)
    metrics = ServerMetrics(MODEL, llm.max_model_len)
    llm.stats_listener = metrics
    app = build_app(OpenAIServing(llm, MODEL, chat_model_dir), metrics)
    try:
        with TestClient(app, raise_server_exceptions=False) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
            yield llm, client, http
    finally:
        llm.shutdown()


def post(http, endpoint: str, fields: dict):
    body = {"model": MODEL, **BASES[endpoint]} | fields
    # json.dumps escapes every non-ASCII character, so a lone surrogate travels as JSON's \\udXXX escape
    return http.post(PATHS[endpoint], content=json.dumps(body), headers={"Content-Type": "application/json"})


def assert_400(response, param: str | None, fragment: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert fragment in error["message"], error
    return error["message"]


def assert_nothing_left(llm: AsyncLLM) -> None:
    """No stream in the frontend's request table, no request in the engine."""
    assert llm.streams == {}
    assert llm.stats is None or (llm.stats.num_running == 0 and llm.stats.num_waiting == 0)


BIG = 2**64
OUT_OF_RANGE = "out of range: an integer in a request must be within [-2**63, 2**64 - 1]"


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "fragment"),
    [
        ("completions", dict(prompt=[BIG]), "prompt", f"prompt[0] is {BIG}, which is {OUT_OF_RANGE}"),
        ("completions", dict(prompt=[[5, 6], [7, -BIG]]), "prompt", "prompt[1][1] is -18446744073709551616"),
        ("completions", dict(n=BIG), "n", OUT_OF_RANGE),
        ("completions", dict(n=-(2**63) - 1), "n", OUT_OF_RANGE),
        ("completions", dict(stop_token_ids=[5, BIG]), "stop_token_ids", "stop_token_ids[1]"),
        ("completions", dict(logit_bias={str(BIG): 1.0}), "logit_bias", "logit_bias keys must be token ids"),
        ("completions", dict(seed=BIG), "seed", OUT_OF_RANGE),
        ("completions", dict(max_tokens=BIG), "max_tokens", OUT_OF_RANGE),
        ("completions", dict(min_tokens=BIG), "min_tokens", OUT_OF_RANGE),
        ("completions", dict(top_k=BIG), "top_k", OUT_OF_RANGE),
        ("completions", dict(logprobs=BIG), "logprobs", OUT_OF_RANGE),
        ("completions", dict(prompt_logprobs=-BIG), "prompt_logprobs", OUT_OF_RANGE),
        ("completions", dict(temperature=BIG), "temperature", OUT_OF_RANGE),
        ("completions", dict(priority=10**30), "priority", OUT_OF_RANGE),  # an extra field, checked all the same
        ("chat", dict(n=BIG), "n", OUT_OF_RANGE),
        ("chat", dict(top_logprobs=BIG, logprobs=True), "top_logprobs", OUT_OF_RANGE),
        ("chat", dict(max_completion_tokens=BIG), "max_completion_tokens", OUT_OF_RANGE),
        ("chat", dict(chat_template_kwargs={"depth": BIG}), "chat_template_kwargs", "chat_template_kwargs.depth"),
        ("responses", dict(max_output_tokens=BIG), "max_output_tokens", OUT_OF_RANGE),
        ("responses", dict(temperature=-BIG), "temperature", OUT_OF_RANGE),
        ("responses", dict(metadata={"run": BIG}), "metadata", "metadata.run is"),
        (
            "responses",
            dict(
                input=[{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "n": BIG}]}]
            ),
            "input",
            "input[0].output[0].n is",
        ),
        (
            "responses",
            dict(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "maxProperties": BIG}}]),
            "tools",
            "tools[0].parameters.maxProperties is",
        ),
        ("responses", dict(max_output_tokens=2**63), "max_output_tokens", "or max_output_tokens."),
        # within 64 bits, outside the field's own range: refused before or by the engine core, all the same
        ("completions", dict(prompt=[2**63]), "prompt", "outside the vocabulary"),
        ("completions", dict(stop_token_ids=[2**63]), "stop_token_ids", "outside the vocabulary"),
        ("completions", dict(logit_bias={str(2**63): 1.0}), "logit_bias", "outside the vocabulary"),
        ("completions", dict(n=2**63), "n", "n=9223372036854775808 samples cannot run at once"),
        ("completions", dict(n=2, seed=2**64 - 1), "seed", "seed + n - 1"),
        ("completions", dict(max_tokens=-(2**63)), "max_tokens", "max_tokens must be an int >= 1"),
    ],
)
def test_out_of_range_integers_are_400_naming_the_field_and_leave_nothing(
    app_server, endpoint, fields, param, fragment
):
    llm, client, http = app_server
    assert_400(post(http, endpoint, fields), param, fragment)
    assert_nothing_left(llm)
    assert client.completions.create(model=MODEL, prompt="Paris", max_tokens=2).usage.completion_tokens == 2


def test_out_of_range_ids_in_tokenize_and_detokenize(app_server):
    llm, _, http = app_server
    assert_400(http.post("/detokenize", json={"tokens": [1, BIG]}), "tokens", "tokens[1]")
    assert_400(http.post("/detokenize", json={"tokens": [2**63]}), "tokens", "outside the vocabulary")
    assert_nothing_left(llm)


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "fragment"),
    [
        (
            "completions",
            dict(prompt="Paris \ud800 is"),
            "prompt",
            "prompt holds a lone surrogate U+D800 at character 6",
        ),
        ("completions", dict(prompt=["fine", "\udfff"]), "prompt", "prompt[1] holds a lone surrogate U+DFFF"),
        ("completions", dict(stop=["\ud83d"]), "stop", "stop[0] holds a lone surrogate U+D83D"),
        (
            "chat",
            dict(messages=[{"role": "user", "content": "hi \udc00"}]),
            "messages",
            "messages[0].content holds a lone surrogate U+DC00",
        ),
        ("responses", dict(input="Paris \ud800 is"), "input", "input holds a lone surrogate U+D800 at character 6"),
        (
            "responses",
            dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "\udfff"}]}]),
            "input",
            "input[0].content[0].text holds a lone surrogate U+DFFF",
        ),
        ("responses", dict(instructions="Be \ud83d"), "instructions", "instructions holds a lone surrogate"),
        (
            "responses",
            dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
            "text",
            "text.format.schema (a JSON schema) cannot be compiled",
        ),
        (
            "responses",
            dict(chat_template_kwargs={"tools": []}),
            "chat_template_kwargs",
            "chat_template_kwargs.tools: tools is a field of the request itself",
        ),
        (
            "chat",
            dict(chat_template_kwargs={"add_generation_prompt": False}),
            "chat_template_kwargs",
            "chat_template_kwargs.add_generation_prompt: add_generation_prompt is a field of the request itself",
        ),
        (
            "chat",
            dict(chat_template_kwargs={"tokenize": False}),
            "chat_template_kwargs",
            "chat_template_kwargs.tokenize: the server sets tokenize itself",
        ),
        (
            "chat",
            dict(chat_template_kwargs={"conversation": []}),
            "chat_template_kwargs",
            "the server sets conversation itself",
        ),
    ],
)
def test_error_messages_speak_in_request_terms(app_server, endpoint, fields, param, fragment):
    """A lone surrogate and a chat_template_kwargs key that clashes with the server's own arguments: the message
    names the field and says what is wrong, not which library call failed."""
    llm, _, http = app_server
    message = assert_400(post(http, endpoint, fields), param, fragment)
    for internal in ("TextEncodeInput", "apply_chat_template()", "keyword argument", "transformers.", "codec"):
        assert internal not in message, message
    assert_nothing_left(llm)


def test_paired_surrogates_and_template_variables_are_fine(app_server):
    _, client, _ = app_server
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "fox \U0001f98a"}],  # JSON sends it as the pair \ud83e\udd8a
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        max_tokens=2,
    )
    assert reply.usage.completion_tokens == 2


def test_bodies_over_max_request_bytes_are_413_sized_or_chunked(app_server, chat_model_dir):
    """With --max-request-bytes 2000: a body declared larger is refused at once; a body sent in chunks (no
    Content-Length) is counted as it comes, refused past the limit and handed on whole below it."""
    llm, _, _ = app_server
    app = build_app(OpenAIServing(llm, MODEL, chat_model_dir), ServerMetrics(MODEL, 512), max_request_bytes=2000)
    headers = {"Content-Type": "application/json"}

    def chunked(text: str):
        for start in range(0, len(text), 300):
            yield text[start : start + 300].encode()

    large = json.dumps({"model": MODEL, "prompt": "x" * 3000, "max_tokens": 1})
    small = json.dumps({"model": MODEL, "prompt": "Paris " * 100, "max_tokens": 2})
    with TestClient(app, raise_server_exceptions=False) as http:
        for response in (
            http.post("/v1/completions", content=large, headers=headers),
            http.post("/v1/completions", content=chunked(large), headers=headers),
        ):
            assert response.status_code == 413, response.text
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and "limit of 2000 bytes" in error["message"], error
        response = http.post("/v1/completions", content=chunked(small), headers=headers)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text
    assert_nothing_left(llm)


# --- every field is honoured or refused -----------------------------------------------------------------------


def test_sampling_fields_reach_sampling_params():
    """Each sampling field of a request, with a value other than its default, lands in SamplingParams (whose
    meaning the engine's and sampler's tests check)."""
    values = dict(
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"7": 3.0},
        n=3,
        seed=11,
        stop=["fox"],
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[4, 9],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    request = CompletionRequest(prompt="x", **values)
    params = request.to_sampling_params(max_tokens=8, logprobs=2, prompt_logprobs=1)
    for name, value in values.items():
        expected = {int(k): v for k, v in value.items()} if name == "logit_bias" else value
        assert getattr(params, name) == expected, name
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (8, 2, 1)


class RecordingTokenizer:
    """The tokenizer, recording what apply_chat_template is given, and in which thread."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.calls: list[dict] = []
        self.threads: list[threading.Thread] = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append(kwargs)
        self.threads.append(threading.current_thread())
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


def test_chat_fields_reach_the_chat_template(app_server):
    """add_generation_prompt, continue_final_message and chat_template_kwargs, as the chat template gets them."""
    llm, _, _ = app_server
    serving = OpenAIServing(llm, MODEL, "")
    serving.tokenizer = recording = RecordingTokenizer(llm.tokenizer)
    request = ChatCompletionRequest(
        messages=USER, add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False}
    )
    without = serving.chat_prompt(
        request.messages, request.add_generation_prompt, request.continue_final_message, request.chat_template_kwargs
    )
    assert recording.calls[-1]["add_generation_prompt"] is False and recording.calls[-1]["enable_thinking"] is False
    with_prompt = serving.chat_prompt(request.messages, add_generation_prompt=True)
    assert llm.tokenizer.decode(with_prompt.token_ids) == llm.tokenizer.decode(without.token_ids) + "<s>assistant:"
    serving.chat_prompt(request.messages, add_generation_prompt=True, continue_final_message=True)
    assert recording.calls[-1]["continue_final_message"] is True
    assert recording.calls[-1]["add_generation_prompt"] is False  # continuing the last message adds no new turn


def test_responses_fields_reach_the_chat_request():
    """/v1/responses runs as a chat request: each field it hands on arrives as the chat request's own (whose effect
    the chat tests show), the sampling ones in SamplingParams; vLLM's sampling extras too."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    extras = dict(
        frequency_penalty=0.5, presence_penalty=0.25, seed=11, stop=["END"], min_p=0.05, repetition_penalty=1.2,
        min_tokens=2, ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True,
    )  # fmt: skip
    assert set(extras) == set(SAMPLING_EXTRAS)
    request = ResponsesRequest(
        input="x", instructions="Be brief.", tools=[tool], tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False, max_output_tokens=7, temperature=0.7, top_p=0.9, top_k=5, logit_bias={"7": 3.0},
        skip_special_tokens=False, chat_template_kwargs={"enable_thinking": False}, **extras,
    )  # fmt: skip
    chat = chat_request(request)
    assert [(message.role, message.content) for message in chat.messages] == [("system", "Be brief."), ("user", "x")]
    assert [tool.function.name for tool in chat.tools] == ["f"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}} and chat.parallel_tool_calls is False
    assert chat.max_completion_tokens == 7 and chat.chat_template_kwargs == {"enable_thinking": False}
    params = chat.to_sampling_params(max_tokens=7, logprobs=None, prompt_logprobs=None)
    sampling = (params.temperature, params.top_p, params.top_k, params.logit_bias, params.skip_special_tokens)
    assert sampling == (0.7, 0.9, 5, {7: 3.0}, False)
    assert {name: getattr(params, name) for name in extras} == extras
    # Unset, they leave chat's defaults
    unset = chat_request(ResponsesRequest(input="x")).to_sampling_params(
        max_tokens=7, logprobs=None, prompt_logprobs=None
    )
    assert (unset.seed, unset.stop, unset.min_tokens, unset.ignore_eos, unset.frequency_penalty) == (
        None,
        [],
        0,
        False,
        0.0,
    )


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("max_tokens", 5, "use max_output_tokens"),
        ("max_completion_tokens", 5, "use max_output_tokens"),
        ("messages", USER, "its input"),
        ("response_format", {"type": "json_object"}, "use text.format"),
        ("structured_outputs", {"regex": "a+"}, "use text.format"),
        ("n", 2, "one output"),
        ("logprobs", True, "not returned"),
        ("echo", True, "never repeats"),
    ],
)
def test_chat_and_completions_fields_sent_to_responses_are_400s(app_server, field, value, fragment):
    """A field of the other endpoints that /v1/responses would otherwise ignore: a 400 naming it and what to send."""
    llm, _, http = app_server
    assert_400(post(http, "responses", {field: value}), field, fragment)
    assert_nothing_left(llm)


def test_responses_model_metadata_and_user(app_server):
    """Another model's name is a 404; metadata and user come back with the response."""
    llm, client, http = app_server
    response = post(http, "responses", dict(model="gpt-4o"))
    assert response.status_code == 404 and response.json()["error"]["param"] == "model", response.text
    reply = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, metadata={"run": "1"}, user="alice")
    assert (reply.model, reply.metadata, reply.user, reply.usage.output_tokens) == (MODEL, {"run": "1"}, "alice", 2)
    assert_nothing_left(llm)


def test_responses_render_the_prompt_in_a_worker_thread(app_server):
    """/v1/responses' prompt goes through the chat path's worker thread (start_chat), off the event loop: a prompt
    longer than max_model_len is rendered there, then refused (naming input) before it reaches the engine."""
    llm, _, _ = app_server
    serving = OpenAIServing(llm, MODEL, "")
    serving.tokenizer = recording = RecordingTokenizer(llm.tokenizer)
    request = ResponsesRequest(model=MODEL, input="fox " * 600)
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(OpenAIServingResponses(serving).create_response(request))
    assert refused.value.param == "input" and "maximum context length is 512" in str(refused.value)
    assert len(recording.threads) == 1 and recording.threads[0] is not threading.current_thread()
    assert_nothing_left(llm)


def field_names(endpoint: str) -> set[str]:
    model = MODELS[endpoint]
    return set(model.model_fields) | set(model.unsupported_fields) | set(SDK_PARAMS[endpoint])


def test_every_implemented_field_points_to_a_test_that_names_it():
    functions = {}  # "file::function" -> its source, decorators (parametrize) included
    for path in HERE.glob("test_*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                functions[f"{path.name}::{node.name}"] = "\n".join(lines[first - 1 : node.end_lineno])
    for endpoint, fields in IMPLEMENTED.items():
        assert not set(fields) & set(NO_EFFECT[endpoint]), endpoint
        for name, pointer in fields.items():
            assert pointer in functions, f"{endpoint}.{name}: no test {pointer}"
            assert re.search(rf"\b{name}\b", functions[pointer]), f"{endpoint}.{name}: {pointer} does not name it"
            assert name in field_names(endpoint), f"{endpoint}.{name} is listed but not a field"


def a_non_default_value(endpoint: str, name: str):
    """A value of the field's declared type other than its default (anything, for an undeclared field)."""
    model = MODELS[endpoint]
    declared = model.model_fields.get(name)
    neutral = model.unsupported_fields.get(name, (None, ()))[1]
    base = BASES[endpoint]
    for candidate in (2, "x", ["x"], [{"x": 1}], {"x": 1}, True):
        if candidate in neutral or (declared is not None and candidate == declared.default):
            continue
        try:
            model.model_validate(base | {name: candidate})
        except ValidationError:
            continue
        return candidate
    raise AssertionError(f"no value found for {endpoint}.{name}")


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_every_other_field_is_a_400_naming_it(app_server, endpoint):
    """The fields of the request model, of its list of refused fields and of the official SDK's parameters: each is
    implemented (IMPLEMENTED), has no effect by its meaning (NO_EFFECT), or is a 400 naming it."""
    llm, _, http = app_server
    refused = sorted(field_names(endpoint) - set(IMPLEMENTED[endpoint]) - set(NO_EFFECT[endpoint]))
    assert {"completions": "suffix", "chat": "audio", "responses": "previous_response_id"}[endpoint] in refused
    for name in refused:
        value = a_non_default_value(endpoint, name)
        response = post(http, endpoint, {name: value})
        assert response.status_code == 400, f"{endpoint}.{name}={value!r} was accepted: {response.text}"
        assert response.json()["error"]["param"] == name, (name, response.json())
    assert_nothing_left(llm)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_fields_without_effect_are_accepted_and_change_nothing(app_server, endpoint):
    _, _, http = app_server
    examples = {name: NO_EFFECT_EXAMPLES[name] for name in NO_EFFECT[endpoint]}
    length = {"max_output_tokens" if endpoint == "responses" else "max_tokens": 6}
    plain = post(http, endpoint, dict(temperature=0, **length))
    with_them = post(http, endpoint, dict(temperature=0, **length) | examples)
    assert plain.status_code == with_them.status_code == 200, with_them.text
    assert reply_text(endpoint, plain.json()) == reply_text(endpoint, with_them.json())


def reply_text(endpoint: str, body: dict) -> str:
    if endpoint == "responses":
        return "".join(part["text"] for item in body["output"] for part in item["content"])
    choice = body["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def test_a_prompt_too_long_to_fit_by_its_length_alone_is_refused_unread(app_server):
    """Completions and chat: a text longer than chars_per_token_bound x max_model_len characters is a 400 before the
    tokenizer or the template sees it; the bound holds (no text has fewer tokens than it allows), so a prompt that
    might fit is still tokenized and checked as before."""
    llm, _, http = app_server
    serving = OpenAIServing(llm, MODEL, "")
    bound = serving.chars_per_token_bound
    longest = max(llm.tokenizer.get_vocab(), key=len)
    text = llm.tokenizer.convert_tokens_to_string([longest]) * 50
    assert len(llm.tokenizer(text).input_ids) >= len(text) / bound
    huge = "fox " * (bound * llm.max_model_len // 4 + 1)
    for endpoint, fields, param in (
        ("completions", dict(prompt=huge), "prompt"),
        ("completions", dict(prompt=["Hi", huge]), "prompt"),
        ("chat", dict(messages=[{"role": "user", "content": [{"type": "text", "text": huge}]}]), "messages"),
    ):
        assert_400(post(http, endpoint, fields), param, f"the prompt's {len(huge)} characters are at least")
    serving.tokenizer = recording = RecordingTokenizer(llm.tokenizer)
    with pytest.raises(InvalidRequestError, match="characters are at least"):
        asyncio.run(serving.start_chat(ChatCompletionRequest(messages=[{"role": "user", "content": huge}]), "r"))
    assert recording.calls == []  # refused unread
    assert_nothing_left(llm)
