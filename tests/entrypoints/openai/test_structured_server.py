"""The default model (SmolLM2) behind `pagedllm serve`, asked through the openai SDK's parse() for five realistic
pydantic models at once (nested objects, enums, arrays with min/max items, required fields, number ranges): every
reply parses into its model; forced tool calls validate against their tools' schemas; and a chat reply that ends
with the model's own end token (<|im_end|>) has no logprob for it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
pytest.importorskip("llguidance", reason="structured outputs need the structured extra")
openai = pytest.importorskip("openai")
from pydantic import BaseModel, Field  # noqa: E402


class Address(BaseModel):
    street: str = Field(max_length=30)
    city: str = Field(max_length=20)
    postcode: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address


class Order(BaseModel):
    item: Literal["book", "pen", "laptop", "phone"]
    quantity: int = Field(ge=1, le=10)
    tags: list[str] = Field(min_length=1, max_length=3)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    temperature_celsius: float = Field(ge=-50, le=60)
    conditions: Literal["sunny", "cloudy", "rain", "snow"]


class Book(BaseModel):
    title: str = Field(max_length=40)
    year: int = Field(ge=1450, le=2025)
    genres: list[Literal["fiction", "history", "science", "poetry"]] = Field(min_length=1, max_length=2)


class Attendee(BaseModel):
    name: str = Field(max_length=20)
    role: Literal["speaker", "guest", "host"]


class Event(BaseModel):
    name: str = Field(max_length=30)
    is_public: bool
    attendees: list[Attendee] = Field(min_length=1, max_length=3)


QUESTIONS = [
    (Person, "Describe a person who lives in Paris, with their address."),
    (Order, "Write an order for two pens."),
    (Weather, "What is the weather like in Oslo in winter?"),
    (Book, "Describe a famous history book."),
    (Event, "Describe a small public conference with a speaker and a host."),
]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # the session's default-model server (tests/conftest.py), shared with test_lm_eval.py


def test_every_reply_parses_into_its_pydantic_model(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(question):
        response_format, text = question
        messages = [{"role": "user", "content": text}]
        return client.chat.completions.parse(
            model=model, messages=messages, response_format=response_format, temperature=0, max_tokens=200
        )

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # concurrently: the rows of one batch
        replies = list(pool.map(ask, QUESTIONS))
    for (response_format, _), reply in zip(QUESTIONS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, response_format), choice.message.content


# Seeds per forced tool choice on the default model: one request of n=48 each, whose prompt is computed once and
# whose rows decode together. The 200-seed property runs on the tiny checkpoint (test_tools_server.py); here 200 rows
# took 70-200 s of one CI worker, over a third of the suite's budget, for the same check on a real tokenizer.
DEFAULT_MODEL_SEEDS = 48


@pytest.mark.parametrize(
    ("tool_choice", "seed"), [("required", 0), ({"type": "function", "function": {"name": "get_time"}}, 1)]
)
def test_forced_tool_calls_always_validate(server, tool_choice, seed):
    """Seeds at temperature 1 on the default model's own tokenizer (its chat template shows no tools, but the calls
    are forced): every call names a tool and its arguments validate against that tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    from tool_checkpoints import TIME, WEATHER

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather and the time in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        n=DEFAULT_MODEL_SEEDS,
        seed=seed,
        temperature=1.0,
        max_tokens=80,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_chat_logprobs_leave_out_the_end_token(server):
    """The reply ends with <|im_end|>, which its text leaves out: so do its logprobs, which spell the text token by
    token (the end token still counts in usage, as in vLLM)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is 2+2? Reply with just the number."}]
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, logprobs=True, temperature=0, max_tokens=30
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "<|im_end|>" not in tokens and "".join(tokens) == choice.message.content
    assert reply.usage.completion_tokens == len(tokens) + 1
