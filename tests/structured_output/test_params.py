"""StructuredOutputsParams takes exactly one constraint, refuses each bad value with the field's name and what is
allowed, and gives equal cache keys exactly to params that compile to the same grammar."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

BAD = [  # (fields, exception, words the message must hold)
    ({}, ValueError, "exactly one of json, regex, choice, grammar or json_object=True; got none"),
    ({"json_object": False}, ValueError, "got none"),
    ({"json": SCHEMA, "regex": "a+"}, ValueError, "got json, regex"),
    ({"choice": ["a"], "grammar": "start: 'a'", "json_object": True}, ValueError, "got choice, grammar, json_object"),
    ({"choice": []}, ValueError, "choice must hold at least one string"),
    ({"choice": "yes"}, TypeError, "choice must be a list of str, got str"),
    ({"choice": ["yes", 3]}, TypeError, "item 1 is int"),
    ({"json": 5}, TypeError, "json must be a JSON schema as a dict or a JSON str, got int"),
    ({"json": ["type", "object"]}, TypeError, "json must be a JSON schema as a dict or a JSON str, got list"),
    ({"json": "{not json"}, ValueError, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, ValueError, "json must be a JSON schema object, got JSON list"),
    ({"json": {"type": "object", "default": {1, 2}}}, TypeError, "json must hold JSON values only"),
    ({"regex": 5}, TypeError, "regex must be a str or None, got int"),
    ({"regex": ""}, ValueError, "regex must be a non-empty str"),
    ({"grammar": b"start: 'a'"}, TypeError, "grammar must be a str or None, got bytes"),
    ({"grammar": ""}, ValueError, "grammar must be a non-empty str"),
    ({"json_object": 1}, TypeError, "json_object must be True or False, got 1"),
    ({"json_object": True, "whitespace_pattern": 3}, TypeError, "whitespace_pattern must be a str or None"),
    ({"regex": "a+", "whitespace_pattern": " "}, ValueError, "whitespace_pattern applies to json or json_object only"),
]


@pytest.mark.parametrize(("fields", "error", "words"), BAD, ids=[str(case[0])[:60] for case in BAD])
def test_bad_params_are_clear_errors(fields, error, words):
    with pytest.raises(error) as raised:
        StructuredOutputsParams(**fields)
    assert words in str(raised.value)


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"json": SCHEMA}, "json", '{"properties":{"name":{"type":"string"}},"required":["name"],"type":"object"}'),
        ({"json": '{"type":  "integer"}'}, "json", '{"type":"integer"}'),
        ({"regex": r"\d+"}, "regex", r"\d+"),
        ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
        ({"choice": ("yes", "no")}, "choice", '["yes", "no"]'),
        ({"grammar": 'start: "a"'}, "grammar", 'start: "a"'),
        ({"json_object": True}, "json_object", ""),
    ],
)
def test_kind_and_spec(fields, kind, spec):
    params = StructuredOutputsParams(**fields)
    assert params.kind == kind
    assert params.spec == spec


def test_cache_key_is_equal_exactly_for_the_same_grammar():
    as_dict = StructuredOutputsParams(json={"type": "integer", "minimum": 0})
    as_text = StructuredOutputsParams(json='{"minimum": 0, "type": "integer"}')
    assert as_dict.cache_key == as_text.cache_key
    others = [
        StructuredOutputsParams(json={"type": "integer", "minimum": 1}),
        StructuredOutputsParams(json={"type": "integer", "minimum": 0}, whitespace_pattern=" ?"),
        StructuredOutputsParams(regex='{"minimum":0,"type":"integer"}'),
        StructuredOutputsParams(grammar='{"minimum":0,"type":"integer"}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json={"type": "object"}),
    ]
    keys = [as_dict.cache_key] + [params.cache_key for params in others]
    assert len(set(keys)) == len(keys)
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key != StructuredOutputsParams(choice=["a,b"]).cache_key


def test_schema():
    assert StructuredOutputsParams(json_object=True).schema() == {"type": "object"}
    assert StructuredOutputsParams(json='{"type": "integer"}').schema() == {"type": "integer"}
    assert StructuredOutputsParams(json=SCHEMA).schema() is SCHEMA


def test_frozen():
    params = StructuredOutputsParams(regex="a+")
    with pytest.raises(AttributeError):
        params.regex = "b+"


def test_sampling_params_takes_only_structured_outputs_params():
    params = StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs=params).structured_outputs is params
    assert SamplingParams().structured_outputs is None
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["yes", "no"]})
