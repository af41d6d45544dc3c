"""`pagedllm serve` through the official openai client: completions and chat, streamed and not, errors, aborts on
disconnect, and 64 concurrent streams that must equal LLM.generate."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import statistics
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
openai = pytest.importorskip("openai")

from server_process import API_KEY, start_server, stop_server, write_chat_model  # noqa: E402


@pytest.fixture(scope="session")
def chat_model_dir(llama_dir, tmp_path_factory) -> str:
    return write_chat_model(llama_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    limit = ("--max-request-bytes", str(MAX_REQUEST_BYTES))
    running = start_server(chat_model_dir, log_path, "--max-model-len", "512", "--api-key", API_KEY, *limit)
    yield running
    if running.process.poll() is None:  # test_sigterm_... (the last test) normally stopped it already
        running.process.kill()
        running.process.wait()


PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):"]
MAX_REQUEST_BYTES = 8_000_000


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def stream_client(server):
    """For streamed completions: the openai types require finish_reason on every Completion, but a streamed
    chunk (OpenAI's too) carries null until the last one, so strict validation cannot be used there."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def lenient_client(server):
    """For echo with logprobs: the first prompt token has no logprob, so its entries are null (as in OpenAI's legacy
    API and vLLM), which the openai types (lists of float and dict) do not allow under strict validation."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


@pytest.fixture(scope="module")
def offline_llm(chat_model_dir):
    from pagedllm import LLM

    return LLM(chat_model_dir, max_model_len=512)


def greedy(max_tokens: int, **extra) -> dict:
    return dict(temperature=0, max_tokens=max_tokens, **extra)


def test_completion_streamed_equals_whole(client, stream_client, server, tokenizer):
    for prompt in PROMPTS:
        whole = client.completions.create(model=server.model, prompt=prompt, **greedy(12))
        choice = whole.choices[0]
        assert choice.finish_reason == "length"
        assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert whole.usage.completion_tokens == 12
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
        chunks = list(
            stream_client.completions.create(
                model=server.model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy(12)
            )
        )
        text_chunks = [chunk for chunk in chunks if chunk.choices]
        assert "".join(chunk.choices[0].text for chunk in text_chunks) == choice.text
        assert [chunk.choices[0].finish_reason for chunk in text_chunks].count("length") == 1
        assert text_chunks[-1].choices[0].finish_reason == "length"
        assert not chunks[-1].choices and chunks[-1].usage == whole.usage  # the usage chunk comes last


def test_max_tokens_gives_exactly_that_many_tokens(client, server, offline_llm):
    from pagedllm import SamplingParams

    for max_tokens in (1, 7, 30):
        response = client.completions.create(model=server.model, prompt=PROMPTS[0], **greedy(max_tokens))
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == max_tokens
        expected = offline_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        assert len(expected.outputs[0].token_ids) == max_tokens
        assert response.choices[0].text == expected.outputs[0].text


def test_token_id_prompts(client, server, tokenizer):
    ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    single = client.completions.create(model=server.model, prompt=ids[0], **greedy(8))
    as_text = client.completions.create(model=server.model, prompt=PROMPTS[0], **greedy(8))
    assert single.choices[0].text == as_text.choices[0].text
    several = client.completions.create(model=server.model, prompt=ids, **greedy(8))
    assert [choice.index for choice in several.choices] == [0, 1, 2]
    assert several.usage.prompt_tokens == sum(len(prompt) for prompt in ids)
    assert several.usage.completion_tokens == 3 * 8
    for prompt, choice in zip(PROMPTS, several.choices):
        alone = client.completions.create(model=server.model, prompt=prompt, **greedy(8))
        assert choice.text == alone.choices[0].text


def test_several_prompts_streamed(client, stream_client, server):
    whole = client.completions.create(model=server.model, prompt=PROMPTS, **greedy(10))
    texts = {index: "" for index in range(len(PROMPTS))}
    finishes = {index: 0 for index in range(len(PROMPTS))}
    for chunk in stream_client.completions.create(model=server.model, prompt=PROMPTS, stream=True, **greedy(10)):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    assert [texts[i] for i in range(len(PROMPTS))] == [choice.text for choice in whole.choices]
    assert set(finishes.values()) == {1}


def test_chat_streamed_and_not(client, server, offline_llm):
    from pagedllm import SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown"}]
    whole = client.chat.completions.create(model=server.model, messages=messages, **greedy(10))
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    expected = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert choice.message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=messages, stream=True, stream_options={"include_usage": True}, **greedy(10)
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks) == choice.message.content
    assert [chunk.choices[0].finish_reason for chunk in content_chunks].count("length") == 1
    # the same counts (the streamed request found the prompt's first blocks in the prefix cache, the first did not)
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    max_completion = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_completion_tokens=4
    )
    assert max_completion.usage.completion_tokens == 4


def test_models_list(client, server):
    models = client.models.list().data
    assert [model.id for model in models] == [server.model]
    raw = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert raw["data"][0]["max_model_len"] == 512
    assert raw["data"][0]["root"] == server.model_dir


def test_models_retrieve(client, server):
    """GET /v1/models/{id}, the served name holding slashes (a path); another name is OpenAI's 404."""
    model = client.models.retrieve(server.model)
    assert model.id == server.model and model.object == "model" and "/" in server.model
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert_openai_error(caught.value, 404, "no-such-model")
    assert caught.value.response.json()["error"]["code"] == "model_not_found"


def test_health_version_tokenize_detokenize(server, tokenizer):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPTS[1])
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == tokenizer.decode(tokens["tokens"])
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["bos_token"] == tokenizer.bos_token and info["chat_template"] == tokenizer.chat_template
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def assert_openai_error(error: openai.APIStatusError, status: int, fragment: str) -> None:
    assert error.status_code == status
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert fragment in body["message"], body
    assert "Traceback" not in error.response.text


@pytest.mark.parametrize(
    ("arguments", "status", "fragment"),
    [
        (dict(temperature=-1.0), 400, "temperature"),
        (dict(max_tokens=10_000), 400, "maximum context length"),
        (dict(prompt="x " * 600), 400, "maximum context length"),
        (dict(prompt=[10**6]), 400, "vocabulary"),
        (dict(prompt=[]), 400, "prompt"),
        (dict(presence_penalty=5.0), 400, "presence_penalty must be in [-2, 2]"),
        (dict(n=2, seed=2**64 - 1), 400, "seed + n - 1"),
        (dict(logit_bias={"999999": 1.0}), 400, "outside the vocabulary"),
        (dict(model="no-such-model"), 404, "no-such-model"),
    ],
)
def test_errors_then_a_good_request(client, server, arguments, status, fragment):
    request = dict(model=server.model, prompt="The quick brown", max_tokens=4) | arguments
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**request)
    assert_openai_error(caught.value, status, fragment)
    assert client.completions.create(model=server.model, prompt="Paris is", max_tokens=2).usage.completion_tokens == 2


def test_wrong_or_missing_key_is_401(server, client):
    for key in ("wrong-key", ""):
        bad_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key or "x", max_retries=0)
        headers = {} if key else {"Authorization": ""}
        with pytest.raises(openai.AuthenticationError) as caught:
            bad_client.completions.create(model=server.model, prompt="x", max_tokens=2, extra_headers=headers)
        assert_openai_error(caught.value, 401, "API key")
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # only /v1 needs the key
    assert client.models.list().data


def test_malformed_json_and_unknown_fields(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body in ('{"prompt": "x", ', "[1, 2]", '{"max_tokens": 3}'):
        response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 2, "frobnicate": True, "logprobs_mode": 3},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    assert client.completions.create(model=server.model, prompt="Paris", max_tokens=2).choices


USER = [{"role": "user", "content": "The quick brown"}]
ONE_OF = {"choice": ["yes", "no"]}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "fragment"),
    [
        # structured outputs: parsed and checked by the server; constraints the library refuses, by the engine
        ("chat", dict(response_format={"type": "json_schema"}), "response_format", "needs json_schema"),
        ("chat", dict(response_format={"type": "xml"}), "response_format", "response_format.type"),
        (
            "chat",
            dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format",
            "name",
        ),
        ("chat", dict(structured_outputs={"choice": []}), "structured_outputs", "at least one string"),
        ("chat", dict(structured_outputs={"regex": "a", "json_object": True}), "structured_outputs", "exactly one"),
        ("chat", dict(structured_outputs={"structural_tag": "{}"}), "structured_outputs", "structural_tag"),
        (
            "chat",
            dict(structured_outputs=ONE_OF, response_format={"type": "json_object"}),
            "structured_outputs",
            "not both",
        ),
        # tools: "auto" (the default with tools) needs the tool parser this server was not started with
        ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice", "--tool-call-parser"),
        ("chat", dict(tool_choice="required"), "tool_choice", "'required' needs tools"),
        ("chat", dict(functions=[{"name": "f"}]), "functions", "functions is not supported"),
        ("chat", dict(function_call={"name": "f"}), "function_call", "function_call is not supported"),
        (
            "chat",
            dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
            "messages",
            "messages.0.tool_calls.0.function",
        ),
        # fields that would change the output if they were honoured
        ("chat", dict(modalities=["text", "audio"]), "modalities", "text only"),
        ("chat", dict(reasoning_effort="high"), "reasoning_effort", "reasoning_effort is not supported"),
        ("chat", dict(echo=True), "echo", "/v1/completions"),
        ("chat", dict(prompt_logprobs=2), "prompt_logprobs", "/v1/completions"),
        ("chat", dict(chat_template="{{ 1 }}"), "chat_template", "chat_template is not supported"),
        ("chat", dict(add_special_tokens=True), "add_special_tokens", "add_special_tokens is not supported"),
        ("chat", dict(guided_json={"type": "object"}), "guided_json", "use structured_outputs"),
        ("completions", dict(guided_choice=["a"]), "guided_choice", "use structured_outputs"),
        ("completions", dict(use_beam_search=True), "use_beam_search", "beam search"),
        ("completions", dict(best_of=2), "best_of", "best_of is not supported"),
        ("completions", dict(add_special_tokens=False), "add_special_tokens", "always added"),
        ("completions", dict(allowed_token_ids=[5]), "allowed_token_ids", "allowed_token_ids is not supported"),
        ("completions", dict(bad_words=["fox"]), "bad_words", "bad_words is not supported"),
        ("completions", dict(truncate_prompt_tokens=4), "truncate_prompt_tokens", "never truncated"),
        ("completions", dict(priority=1), "priority", "first come, first served"),
        ("completions", dict(cache_salt="tenant-1"), "cache_salt", "cache_salt is not supported"),
        ("completions", dict(return_tokens_as_token_ids=True), "return_tokens_as_token_ids", "returned as text"),
    ],
)
def test_fields_that_would_be_ignored_are_400_naming_them(server, client, endpoint, fields, param, fragment):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = dict(messages=USER) if endpoint == "chat" else dict(prompt="The quick brown")
    path = "chat/completions" if endpoint == "chat" else "completions"
    body = {"model": server.model, "max_tokens": 3, **base, **fields}
    response = httpx.post(f"{server.base_url}/v1/{path}", json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert fragment in error["message"], error
    assert error["param"] == param, error
    assert client.completions.create(model=server.model, prompt="Paris is", max_tokens=2).usage.completion_tokens == 2


def starts_a_json_object(text: str, finish_reason: str) -> bool:
    """The whole object once the grammar ended it, else its beginning."""
    return isinstance(json.loads(text), dict) if finish_reason == "stop" else text.startswith("{")


def one_of_the_choices(text: str, finish_reason: str) -> bool:
    return text in ONE_OF["choice"] and finish_reason == "stop"


def lowercase_letters(text: str, finish_reason: str) -> bool:
    return text.isalpha() and text.islower() and finish_reason == "length"  # [a-z]+ never ends by itself


@pytest.mark.parametrize(
    ("endpoint", "fields", "satisfied"),
    [
        ("chat", dict(response_format={"type": "json_object"}), starts_a_json_object),
        ("chat", dict(response_format=SCHEMA_FORMAT), starts_a_json_object),
        ("chat", dict(structured_outputs={"regex": "[a-z]+", "disable_fallback": False}), lowercase_letters),
        ("completions", dict(structured_outputs=ONE_OF), one_of_the_choices),
        ("completions", dict(response_format={"type": "json_object"}), starts_a_json_object),
    ],
)
def test_structured_outputs_constrain_chat_and_completions(server, client, endpoint, fields, satisfied):
    """The tiny model has no EOS: an output ends when its grammar is complete ("stop") or at max_tokens."""
    if endpoint == "chat":
        reply = client.chat.completions.create(model=server.model, messages=USER, extra_body=fields, **greedy(6))
        text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
    else:
        reply = client.completions.create(model=server.model, prompt="Paris is", extra_body=fields, **greedy(6))
        text, reason = reply.choices[0].text, reply.choices[0].finish_reason
    assert satisfied(text, reason), (text, reason)


@pytest.mark.parametrize(
    ("structured_outputs", "fragment"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "Invalid type: nope"),
        ({"json": {"type": "object", "if": {"type": "object"}}}, "Unimplemented keys"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_the_library_refuses_are_400_and_others_are_served(
    server, client, stream_client, structured_outputs, fragment, stream
):
    """Refused when compiled in the engine core, before the response starts (streamed too); others run on."""
    (kind,) = structured_outputs
    create = (stream_client if stream else client).chat.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(model=server.model, messages=USER, stream=stream, extra_body={"structured_outputs": structured_outputs})
    assert_openai_error(caught.value, 400, f"structured_outputs.{kind}")
    assert fragment in caught.value.response.json()["error"]["message"]
    assert client.completions.create(model=server.model, prompt="Paris is", max_tokens=2).usage.completion_tokens == 2


def test_neutral_values_of_unsupported_fields_are_accepted(client, server):
    chat = client.chat.completions.create(
        model=server.model,
        messages=USER,
        response_format={"type": "text"},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="none",
        extra_body=dict(use_beam_search=False, priority=0, modalities=["text"], structured_outputs=None, echo=False),
        **greedy(3),
    )
    assert chat.usage.completion_tokens == 3
    completion = client.completions.create(
        model=server.model, prompt="Paris is", extra_body=dict(best_of=1, add_special_tokens=True), **greedy(3)
    )
    assert completion.usage.completion_tokens == 3


def test_message_names_reach_the_chat_template(server, tokenizer):
    for message, rendered in (({"name": "alice"}, "user alice: Hi"), ({}, "user: Hi")):
        messages = [{"role": "user", "content": "Hi", **message}]
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
        assert rendered in tokenizer.decode(tokens)


def wait_for(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_disconnect_aborts_and_frees_blocks(server, client, stream_client, endpoint):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    long_request = dict(model=server.model, stream=True, max_tokens=480, temperature=0)
    if endpoint == "completions":
        stream = stream_client.completions.create(prompt="The quick brown", **long_request)
    else:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **long_request)
    for received, _chunk in enumerate(stream, start=1):
        if received == 3:
            break
    assert server.metric("vllm:num_requests_running") == 1  # still generating when the client leaves
    stream.close()
    assert wait_for(lambda: server.metric("vllm:request_success_total", finished_reason="abort") > aborted_before)
    assert wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0  # its blocks are free
    assert client.completions.create(model=server.model, prompt="Paris", max_tokens=2).choices


def test_non_streamed_disconnect_aborts(server):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    # 32 samples with 20 logprobs each: ~2.8 s of work on a 2-core CPU, where one sample of 480 tokens took ~0.3 s,
    # the client's own timeout, and sometimes finished before the server saw the client leave
    body = {"model": server.model, "prompt": "The quick brown", "max_tokens": 480, "ignore_eos": True, "n": 32,
            "logprobs": 20}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(5.0, read=0.3),
        )
    assert wait_for(lambda: server.metric("vllm:request_success_total", finished_reason="abort") > aborted_before)
    assert wait_for(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0)


def test_64_concurrent_streams_equal_llm_generate(server, offline_llm):
    from pagedllm import SamplingParams

    generator = random.Random(0)
    prompts = [[generator.randrange(2, 384) for _ in range(generator.randint(1, 120))] for _ in range(64)]
    max_tokens = [generator.randint(1, 40) for _ in range(64)]
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)

    async def stream_one(prompt: list[int], tokens: int) -> tuple[str, str | None, int]:
        text, finishes = "", []
        stream = await client.completions.create(
            model=server.model, prompt=prompt, stream=True, **greedy(tokens), stream_options={"include_usage": True}
        )
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
            else:
                usage = chunk.usage
        assert len(finishes) == 1
        return text, finishes[0], usage.completion_tokens

    async def all_streams():
        async with client:
            return await asyncio.gather(*(stream_one(p, n) for p, n in zip(prompts, max_tokens)))

    results = asyncio.run(all_streams())
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    expected = offline_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for (text, finish_reason, num_tokens), reference in zip(results, expected):
        assert text == reference.outputs[0].text
        assert finish_reason == reference.outputs[0].finish_reason
        assert num_tokens == len(reference.outputs[0].token_ids)
    assert wait_for(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0)


def test_cached_tokens_in_usage_and_metrics(client, stream_client, server):
    """usage.prompt_tokens_details.cached_tokens counts the prompt tokens found in the prefix cache (whole blocks
    of 16), streamed and not, for completions and chat; /metrics adds them up in vllm:prompt_tokens_cached_total."""
    cached_before = server.metric("vllm:prompt_tokens_cached_total")
    prompt = f"{random.Random().randrange(10**9)} Paged attention keeps the KV cache in fixed-size blocks. " * 2
    first = client.completions.create(model=server.model, prompt=prompt, **greedy(2)).usage
    assert first.prompt_tokens > 32 and first.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=server.model, prompt=prompt, **greedy(2)).usage
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens and cached % 16 == 0, again
    options = dict(stream=True, stream_options={"include_usage": True})
    streamed = list(stream_client.completions.create(model=server.model, prompt=prompt, **options, **greedy(2)))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": prompt}]
    chat_first = client.chat.completions.create(model=server.model, messages=messages, **greedy(2)).usage
    chat_streamed = list(client.chat.completions.create(model=server.model, messages=messages, **options, **greedy(2)))
    chat_cached = chat_streamed[-1].usage.prompt_tokens_details.cached_tokens
    assert chat_first.prompt_tokens_details.cached_tokens == 0 and 0 < chat_cached < chat_first.prompt_tokens
    assert server.metric("vllm:prompt_tokens_cached_total") - cached_before == 2 * cached + chat_cached


def test_chat_logprobs_leave_out_the_stop_token(client, stream_client, server, offline_llm):
    """An output ended by a stop token leaves its text out, and so its logprobs: logprobs.content is the message
    text token by token, streamed and not (the token still counts in usage, as in vLLM)."""
    from pagedllm import SamplingParams

    messages = [{"role": "user", "content": "Hi"}]
    reference = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    ids = reference.token_ids
    end = next(index for index in range(2, len(ids)) if ids[index] not in ids[:index])  # first stops the output
    request = dict(model=server.model, messages=messages, logprobs=True, temperature=0, max_tokens=12)
    reply = client.chat.completions.create(**request, extra_body={"stop_token_ids": [ids[end]]})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens == end + 1
    tokens = [entry.token for entry in choice.logprobs.content]
    assert len(tokens) == end and "".join(tokens) == choice.message.content
    chunks = list(
        stream_client.chat.completions.create(**request, stream=True, extra_body={"stop_token_ids": [ids[end]]})
    )
    streamed = [
        entry.token
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert streamed == tokens


def test_a_large_request_does_not_stall_other_streams(server, client, stream_client):
    """While a request over --max-request-bytes (20 MB) is refused with a 413, and a large prompt under it is
    refused for its length (unread: its characters alone cannot fit; a shorter one is tokenized in a worker thread,
    test_request_fields.py), a small stream goes on: no gap between its chunks comes near the time the large prompt
    took. (Tokenized on the event loop, the stream stalled for all of it.)"""
    gaps: list[tuple[float, float]] = []  # (previous chunk, this chunk) of the small streams
    done = threading.Event()

    def small_streams() -> None:
        last = time.monotonic()
        while not done.is_set():  # one stream after another, as long as the large requests last
            for _chunk in stream_client.completions.create(
                model=server.model, prompt="The quick", stream=True, **greedy(64)
            ):
                now = time.monotonic()
                gaps.append((last, now))
                last = now

    streaming = threading.Thread(target=small_streams)
    streaming.start()
    assert wait_for(lambda: len(gaps) >= 5)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=server.model, prompt="x" * 20_000_000, max_tokens=1)
    assert_openai_error(caught.value, 413, f"over this server's limit of {MAX_REQUEST_BYTES} bytes")
    large_prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 18_000  # 1 MB
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt=large_prompt, max_tokens=1)
    end = time.monotonic()
    assert_openai_error(caught.value, 400, "maximum context length")
    done.set()
    streaming.join(timeout=30)
    during = [now - previous for previous, now in gaps if now > start and previous < end]
    # A busy machine stretches every gap: the bound grows with the stream's own gaps before the large requests.
    typical = statistics.median(now - previous for previous, now in gaps if now <= start)
    bound = max(0.25, 5 * typical, min(1.0, (end - start) / 2))
    assert max(during) < bound, f"a {max(during):.2f} s gap while the large prompt took {end - start:.2f} s"
    assert len(during) >= 2, f"the small streams stopped while the large prompt ({end - start:.2f} s) ran"


# The series vLLM's Grafana dashboard (vllm examples/online_serving/prometheus_grafana/grafana.json) queries, each
# filtered by {model_name="$model_name"}, the variable it takes from label_values({__name__=~"vllm:.*"}, model_name).
GRAFANA_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def test_metrics_use_vllm_names(server):
    """Every series vLLM's Grafana dashboard reads, under vLLM's names and its model_name label, and vLLM v1's
    newer names beside them; nothing left under another prefix."""
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in GRAFANA_SERIES + (
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        lines = [line for line in text.splitlines() if line.startswith(f"{name}{{")]
        assert lines and all(f'model_name="{server.model}"' in line for line in lines), name
    assert all(line.startswith(("#", "vllm:")) for line in text.splitlines() if line), text
    assert server.metric("vllm:prefix_cache_hits_total") > 0  # the same prompts were sent again and again
    assert server.metric("vllm:generation_tokens_total") >= server.metric("vllm:request_success_total")
    assert server.metric("vllm:time_per_output_token_seconds_count") == server.metric(
        "vllm:inter_token_latency_seconds_count"
    )


# --- these need sampling stage 2 (n > 1, logprobs, stop strings); they must start passing then -------------------


def test_n_2(client, stream_client, server):
    response = client.completions.create(model=server.model, prompt=PROMPTS[0], n=2, max_tokens=6, seed=1)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert all(choice.finish_reason == "length" for choice in response.choices)
    assert response.usage.completion_tokens == 12
    finishes = {0: 0, 1: 0}
    for chunk in stream_client.completions.create(model=server.model, prompt=PROMPTS, n=2, max_tokens=6, stream=True):
        for choice in chunk.choices:
            finishes.setdefault(choice.index, 0)
            finishes[choice.index] += choice.finish_reason is not None
    assert finishes == {index: 1 for index in range(6)}


def test_echo_with_logprobs_equals_transformers(lenient_client, server, chat_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[1]
    response = lenient_client.completions.create(
        model=server.model, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    logprobs = response.choices[0].logprobs
    ids = tokenizer.encode(prompt)
    assert response.choices[0].text.startswith(prompt)
    assert len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_softmax = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for position, token_id in enumerate(ids[1:], start=1):
        assert logprobs.token_logprobs[position] == pytest.approx(log_softmax[position - 1, token_id].item(), abs=1e-4)
        assert len(logprobs.top_logprobs[position]) >= 2
    greedy_next = int(log_softmax[-1].argmax())
    assert logprobs.token_logprobs[-1] == pytest.approx(log_softmax[-1, greedy_next].item(), abs=1e-4)
    assert logprobs.token_logprobs[-1] == pytest.approx(max(logprobs.top_logprobs[-1].values()), abs=1e-6)


def test_chat_logprobs(client, server):
    response = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=3, **greedy(5)
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the most likely


def test_stop_strings(client, stream_client, server):
    reference = client.completions.create(model=server.model, prompt=PROMPTS[0], **greedy(30)).choices[0].text
    stop = reference[10:13]
    expected = reference[: reference.index(stop)]
    response = client.completions.create(model=server.model, prompt=PROMPTS[0], stop=[stop], **greedy(30))
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == stop
    streamed = stream_client.completions.create(
        model=server.model, prompt=PROMPTS[0], stop=stop, stream=True, **greedy(30)
    )
    chunks = [chunk.choices[0] for chunk in streamed]
    assert "".join(chunk.text for chunk in chunks) == expected
    assert [chunk.finish_reason for chunk in chunks].count("stop") == 1


# --- last: stops the module's server ---------------------------------------------------------------------------


def test_sigterm_ends_streams_and_exits_zero(server, stream_client):
    """SIGTERM with a completion, a chat and a Responses stream in flight: each ends cleanly, the completion's and
    the chat's last choice chunk carrying finish_reason "abort" (so a client can tell a cut answer from a finished one),
    then [DONE]; the response's last event is response.failed (status "failed", error code "server_error"). The server
    exits with status 0, having logged no traceback during the whole module. (Last in the file: it stops the shared
    server.)"""
    body = {"model": server.model, "prompt": "The quick", "max_tokens": 480, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = stream_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=480, stream=True
    )
    response = stream_client.responses.create(model=server.model, input="Hi", max_output_tokens=480, stream=True)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
        assert next(iter(chat)).choices[0].delta.role == "assistant"
        assert next(iter(response)).type == "response.created"
        status = stop_server(server, signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    chat_rest = list(chat)
    events = list(response)
    assert [event.type for event in events].count("response.failed") == 1 and events[-1].type == "response.failed"
    cut = events[-1].response
    assert (cut.status, cut.error.code) == ("failed", "server_error") and "aborted" in cut.error.message
    assert cut.usage.output_tokens < 480 and all(item.status == "incomplete" for item in cut.output)
    assert status == 0, f"SIGTERM should end the server with status 0, got {status}:\n{server.log()}"
    assert rest and rest[-1] == "data: [DONE]" and len(rest) < 480
    last = json.loads(rest[-2].removeprefix("data: "))
    assert [choice["finish_reason"] for choice in last["choices"]] == ["abort"]
    assert all(json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] is None for line in rest[:-2])
    assert chat_rest and chat_rest[-1].choices[0].finish_reason == "abort" and len(chat_rest) < 480
    assert all(chunk.choices[0].finish_reason is None for chunk in chat_rest[:-1])
    assert "Traceback" not in server.log(), server.log()
