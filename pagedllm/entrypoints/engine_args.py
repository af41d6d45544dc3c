"""Every command's engine flags, one per EngineConfig field, generated from FIELD_RULES (type and help) and
EngineConfig's defaults, as vLLM's EngineArgs.add_cli_args does; and error messages that name the flag a user typed
instead of the setting behind it. Argparse and pagedllm.config only, so `pagedllm --help` stays fast."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from dataclasses import fields

from pagedllm.config import FIELD_RULES, EngineConfig, Rule

NO_TOKENIZER = "its prompts are token ids: bench runs without a tokenizer"
# The fields a command takes no flag for, and why; every other EngineConfig field is a flag of every command.
EXCLUDED: dict[str, dict[str, str]] = {
    "chat": {"skip_tokenizer_init": "a chat is text: it needs the tokenizer"},
    "generate": {"skip_tokenizer_init": "prompts and completions are text: they need the tokenizer"},
    "bench": {
        "model": "bench writes and loads a checkpoint of random weights of --shape",
        "gguf_file": "bench writes and loads a checkpoint of random weights of --shape",
        "tokenizer": NO_TOKENIZER,
        "skip_tokenizer_init": NO_TOKENIZER,
        "max_model_len": "the workload sets it: 4096, or with --latency what the shape's longest context needs",
    },
}
DEFAULTS = {field.name: field.default for field in fields(EngineConfig)}


def engine_fields(command: str) -> list[str]:
    """The EngineConfig fields that are flags of this command, in the dataclass's order."""
    return [name for name in DEFAULTS if name not in EXCLUDED.get(command, {})]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, command: str) -> argparse._ArgumentGroup:
    """One flag per field, defaulting to EngineConfig's default; a bool is --name / --no-name. Returns the group."""
    group = parser.add_argument_group("engine", "the engine's settings (LLM's keywords, EngineConfig)")
    names = engine_fields(command)
    for name in names:
        rule, default = FIELD_RULES[name], DEFAULTS[name]
        help_text = name_flags(flag_help(rule, default), names).replace("%", "%%")
        if bool in rule.types:
            group.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            value_type = float if float in rule.types else int if int in rule.types else str
            metavar = "JSON" if dict in rule.types else {float: "X", int: "N", str: None}[value_type]
            group.add_argument(flag(name), type=value_type, default=default, metavar=metavar, help=help_text)
    return group


def flag_help(rule: Rule, default: object) -> str:
    """What the setting does, what it may hold (where that needs no question to the machine: `--help` asks torch
    nothing) and its default; a bool's values are its two flags."""
    allowed = "" if bool in rule.types or callable(rule.allowed) else f"{rule.allowed}; "
    return f"{rule.doc} [{allowed}default: {default}]"


def engine_kwargs(args: argparse.Namespace, command: str) -> dict:
    """The command's engine flags as LLM(...) keywords (EngineConfig fields)."""
    return {name: getattr(args, name) for name in engine_fields(command)}


def name_flags(message: str, names: Iterable[str]) -> str:
    """The message with each setting of `names` written as its flag: every mention of a name with an underscore
    (max_model_len=9000 -> --max-model-len=9000), a one-word name where it is what "must be" something."""
    for name in names:
        ending = r"\b" if "_" in name else r"(?= must be)"
        message = re.sub(rf"(?<![\w-]){name}{ending}", flag(name), message)
    return message


def flag_named_error(error: Exception, args: argparse.Namespace) -> str:
    """The error's message with every engine and sampling setting that is a flag of this command named as the flag."""
    from pagedllm.sampling.params import SamplingParams

    settings = set(DEFAULTS) | {field.name for field in fields(SamplingParams)}
    return name_flags(str(error), [name for name in vars(args) if name in settings])
