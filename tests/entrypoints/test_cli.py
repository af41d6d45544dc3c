"""The `pagedllm` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def pagedllm(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands():
    result = pagedllm("--help")
    assert result.returncode == 0
    assert "chat" in result.stdout and "generate" in result.stdout
    chat_help = pagedllm("chat", "--help")
    assert "--message" in chat_help.stdout and "--threads" in chat_help.stdout


def test_generate_two_prompts(llama_dir):
    result = pagedllm("generate", "The quick brown", "Paris is", "--model", llama_dir, "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "--- [0] The quick brown" in result.stdout and "--- [1] Paris is" in result.stdout


def test_generate_with_an_fp8_kv_cache(llama_dir):
    result = pagedllm(
        "generate", "The quick brown", "--model", llama_dir, "--max-tokens", "3", "--kv-cache-dtype", "fp8"
    )
    assert result.returncode == 0, result.stderr
    assert "GiB, fp8)" in result.stderr  # the start-up log line names the cache dtype


def test_generate_from_file(llama_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\n\ndef add(a, b):\n")
    result = pagedllm("generate", "--file", str(prompts), "--model", llama_dir, "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- [") == 2


def test_chat_message_on_the_default_model():
    result = pagedllm("chat", "--message", "What is the capital of France?", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", "--temperature", "hot"], "invalid float value"),
        (["generate", "x", "--max-tokens", "0"], "max_tokens must be an int >= 1"),
        (["generate", "x", "--threads", "0"], "--threads must be at least 1"),
        (["generate"], "give at least one prompt"),
        (["generate", "--file", "/nonexistent/prompts.txt"], "cannot read --file"),
        (["generate", "x", "--kv-cache-dtype", "fp16"], "kv_cache_dtype must be one of ('auto', 'fp8')"),
        (["launch"], "invalid choice"),
    ],
)
def test_bad_flags(args, message, llama_dir):
    result = pagedllm(*args, "--model", llama_dir) if args[0] != "launch" else pagedllm(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_path():
    result = pagedllm("generate", "hello", "--model", "/nonexistent/model")
    assert result.returncode == 2
    assert "pagedllm: error: model '/nonexistent/model' is neither" in result.stderr


def test_interactive_chat_keeps_the_conversation():
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--max-tokens", "24"]
    questions = "What is the capital of France?\nAnd of Germany?\n\n"
    result = subprocess.run(command, input=questions, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Berlin" in result.stdout
    assert result.stdout.count("> ") == 3  # two questions answered, then the empty line ends the chat
