"""The commands the README and docs/performance.md name exist: every `pagedllm COMMAND --flag` in their code (fenced
blocks and inline spans) is a subcommand of the real parser taking those flags, and every script and file they
point to is in the repository. Read as text; nothing is run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/performance.md"]
# How a command line starts the pagedllm command: first in a shell command (after `time` or VAR=value), or torchrun's
# and python's -m anywhere in it
LAUNCHERS = (("pagedllm",), ("python", "-m", "pagedllm"))
MODULE_LAUNCHER = ("-m", "pagedllm.entrypoints.cli")


def code_of(markdown: str) -> list[str]:
    """The lines of every fenced block and every inline code span."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    without_fences = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    inline = re.findall(r"`([^`\n]+)`", without_fences)
    return [line for block in fenced for line in block.replace("\\\n", " ").splitlines()] + inline


def pagedllm_arguments(words: list[str]) -> list[str] | None:
    """The arguments after `pagedllm` in one shell command, or None where it runs something else."""
    for start in range(len(words) - 1):
        if tuple(words[start : start + 2]) == MODULE_LAUNCHER:
            return words[start + 2 :]
    while words and (words[0] == "time" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
        words = words[1:]
    for launcher in LAUNCHERS:
        if tuple(words[: len(launcher)]) == launcher:
            return words[len(launcher) :]
    return None


def pagedllm_commands(line: str) -> list[list[str]]:
    """Each pagedllm command line in `line` (split at &&, |, ;), as the arguments after `pagedllm`."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unclosed quote: not a shell line (prose in backticks)
        return []
    commands, current = [], []
    for word in [*words, "&&"]:
        if word in ("&&", "|", ";", "||"):
            arguments = pagedllm_arguments(current)
            if arguments:  # `pagedllm` alone is a name in prose
                commands.append(arguments)
            current = []
        else:
            current.append(word)
    return commands


def named_commands() -> list[tuple[str, list[str]]]:
    found = []
    for document in DOCUMENTS:
        for line in code_of((REPO / document).read_text(encoding="utf-8")):
            found += [(document, command) for command in pagedllm_commands(line)]
    return found


def test_the_documents_name_commands():
    commands = {command[0] for _, command in named_commands()}
    assert {"chat", "generate", "serve", "bench", "trace-summary", "--version"} <= commands


NAMED = [pytest.param(*found, id=f"{found[0]}: {' '.join(found[1])}") for found in named_commands()]


@pytest.mark.parametrize(("document", "command"), NAMED)
def test_each_named_command_and_flag_exists(document, command):
    """`pagedllm COMMAND --help` stands for every command."""
    parser = build_parser()
    if command[0].startswith("-"):  # pagedllm --version, --help
        assert command[0] in parser._option_string_actions
        return
    subcommands = parser._subparsers._group_actions[0].choices
    names = list(subcommands) if command[0] == "COMMAND" else [command[0]]
    for name in names:
        assert name in subcommands, f"{document}: `pagedllm {' '.join(command)}`: no such command"
        check_flags(document, command, subcommands[name])


def check_flags(document: str, command: list[str], subparser) -> None:
    """Each --flag is one of the command's, and a value given to a flag of choices is one of them."""
    options = subparser._option_string_actions
    where = f"{document}: `pagedllm {' '.join(command)}`"
    for word, following in zip(command[1:], [*command[2:], None]):
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in options, f"{where}: {subparser.prog} has no {flag}"
            value = word.split("=", 1)[1] if "=" in word else following
            choices = options[flag].choices
            assert choices is None or value in choices, f"{where}: {value!r} is none of {flag}'s {list(choices)}"


def test_the_files_and_scripts_the_documents_name_exist():
    missing = []
    for document in DOCUMENTS:
        markdown = (REPO / document).read_text(encoding="utf-8")
        links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", markdown)
        paths = re.findall(r"(?<![\w/.-])((?:benchmarks|scripts|docs|tests|pagedllm)/[\w/.-]*\w)", markdown)
        for path in {*links, *paths}:
            if not (REPO / path).exists() and not (REPO / Path(document).parent / path).exists():
                missing.append(f"{document}: {path}")
    assert missing == []
