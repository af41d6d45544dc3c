"""StructuredOutputsParams: the one constraint a request puts on its output, with vLLM's names (vLLM 0.12+).

Plain data, checked when built (TypeError for a wrong type, ValueError for a bad value); no backend is imported here.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
ONE_CONSTRAINT = "exactly one of json, regex, choice, grammar or json_object=True"


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or as JSON text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or a GBNF/EBNF one
    json_object: bool = False  # any JSON object
    whitespace_pattern: str | None = None  # a regex for the whitespace between JSON tokens (json / json_object only)

    def __post_init__(self) -> None:
        check_types(self)
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            got = "none" if not given else ", ".join(given)
            raise ValueError(f"structured_outputs takes {ONE_CONSTRAINT}; got {got}")
        if isinstance(self.json, str):
            schema_from_text(self.json)
        elif self.json is not None:
            try:
                json_module.dumps(self.json)
            except (TypeError, ValueError) as error:
                raise TypeError(f"structured_outputs.json must hold JSON values only: {error}") from None
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must hold at least one string, got an empty list")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured_outputs.{name} must be a non-empty str")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ValueError(
                f"structured_outputs.whitespace_pattern applies to json or json_object only, not to {self.kind}"
            )

    @property
    def kind(self) -> str:
        """Which constraint: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: a schema in canonical JSON (a dict and its JSON text give the same spec), a
        choice as a JSON list, a regex or grammar as given, '' for json_object."""
        if self.json is not None:
            schema = schema_from_text(self.json) if isinstance(self.json, str) else self.json
            return json_module.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if self.choice is not None:
            return json_module.dumps(list(self.choice), ensure_ascii=False)
        return self.regex or self.grammar or ""

    @property
    def cache_key(self) -> tuple[str, str, str | None]:
        """Equal for two params that compile to the same grammar: (kind, spec, whitespace_pattern)."""
        return self.kind, self.spec, self.whitespace_pattern

    def schema(self) -> dict[str, Any]:
        """The JSON schema a json or json_object constraint stands for."""
        if self.json_object:
            return {"type": "object"}
        assert self.json is not None, "schema() is for json and json_object constraints"
        return schema_from_text(self.json) if isinstance(self.json, str) else self.json


def check_types(params: StructuredOutputsParams) -> None:
    if params.json is not None and not isinstance(params.json, dict | str):
        raise TypeError(
            f"structured_outputs.json must be a JSON schema as a dict or a JSON str, got {type(params.json).__name__}"
        )
    for name in ("regex", "grammar", "whitespace_pattern"):
        value = getattr(params, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"structured_outputs.{name} must be a str or None, got {type(value).__name__} {value!r}")
    if params.choice is not None:
        if not isinstance(params.choice, list | tuple):
            raise TypeError(f"structured_outputs.choice must be a list of str, got {type(params.choice).__name__}")
        for index, item in enumerate(params.choice):
            if not isinstance(item, str):
                raise TypeError(
                    f"structured_outputs.choice must be a list of str, but item {index} is {type(item).__name__} "
                    f"{item!r}"
                )
    if not isinstance(params.json_object, bool):
        raise TypeError(f"structured_outputs.json_object must be True or False, got {params.json_object!r}")


def schema_from_text(text: str) -> dict[str, Any]:
    try:
        schema = json_module.loads(text)
    except json_module.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got JSON {type(schema).__name__}")
    return schema
