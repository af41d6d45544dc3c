"""The `pagedllm` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

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


HELP_BOUND_S = 2.0  # generous: the help takes ~0.2-0.3 s here (a loaded 2-core machine), 2.8 s when it imported torch
HEAVY_MODULES = ("torch", "transformers", "numpy", "safetensors", "fastapi")


@pytest.mark.parametrize("command", ["", "chat", "generate", "bench", "serve", "trace-summary"])
def test_help_is_quick(command):
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pagedllm", *command.split(), "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert "usage: pagedllm" in result.stdout
    assert elapsed < HELP_BOUND_S, f"pagedllm {command} --help took {elapsed:.2f} s"


def test_the_parser_and_every_help_import_nothing_heavy():
    """What makes --help quick: building the parser and printing every command's help imports no torch."""
    code = (
        "import contextlib, io, sys\n"
        "from pagedllm.entrypoints.cli import build_parser\n"
        "for command in ([], ['chat'], ['generate'], ['bench'], ['serve'], ['trace-summary']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        build_parser().parse_args([*command, '--help'])\n"
        f"print([name for name in {HEAVY_MODULES!r} if name in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_generate_two_prompts_with_an_fp8_kv_cache(llama_dir):
    result = pagedllm(
        "generate", "The quick brown", "Paris is", "--model", llama_dir, "--max-tokens", "5", "--kv-cache-dtype", "fp8"
    )
    assert result.returncode == 0, result.stderr
    assert "--- [0] The quick brown" in result.stdout and "--- [1] Paris is" in result.stdout
    assert "GiB, fp8)" in result.stderr  # the start-up log line names the cache dtype


def test_generate_from_file(llama_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\n\ndef add(a, b):\n")
    result = pagedllm("generate", "--file", str(prompts), "--model", llama_dir, "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- [") == 2


def test_chat_message_on_the_default_model():
    """chat takes every engine flag (tests/entrypoints/test_engine_args.py); here one it lacked before, for real."""
    result = pagedllm(
        "chat", "--message", "What is the capital of France?", "--max-tokens", "16", "--max-model-len", "2048"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", "--temperature", "hot"], "invalid float value"),
        (["generate", "x", "--max-tokens", "0"], "--max-tokens must be an int >= 1"),
        (["generate", "x", "--threads", "0"], "--threads must be a positive int"),
        (["generate"], "give at least one prompt"),
        (["generate", "--file", "/nonexistent/prompts.txt"], "cannot read --file"),
        (["generate", "x", "--kv-cache-dtype", "fp16"], "--kv-cache-dtype must be one of ('auto', 'fp8')"),
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
    """Greedy, so that the answers are the same every run (the chat samples by default)."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--max-tokens", "24", "--temperature", "0"]
    questions = "What is the capital of France?\nAnd of Germany?\n\n"
    result = subprocess.run(command, input=questions, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "Berlin" in result.stdout
    assert result.stdout.count("> ") == 3  # two questions answered, then the empty line ends the chat


def test_generate_with_sampling_flags(llama_dir):
    """--top-k 1 is greedy at any temperature; --stop ends the text before the stop string; --n prints every sample;
    --logprobs prints each token's logprob and rank and the cumulative logprob."""
    from pagedllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    text = LLM(llama_dir, num_kv_blocks=16).generate("The quick brown", greedy, use_tqdm=False)[0].outputs[0].text
    result = pagedllm("generate", "The quick brown", "--model", llama_dir, "--max-tokens", "8", "--top-k", "1",
                      "--temperature", "1.5", "--min-p", "0.01", "--repetition-penalty", "1.0", "--stop", "never",
                      "--stop", text[2:4], "--n", "2", "--logprobs", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split("--- sample ")[1:]
    expected = text[: text.find(text[2:4])] + "\n"
    assert [sample.split("\n", 1)[1].startswith(expected) for sample in samples] == [True, True]
    assert all(sample.count("rank 1 ") >= 1 and "cumulative logprob" in sample for sample in samples)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-k", "-5"], "top_k must be an int >= -1"),
        (["--min-p", "2"], "min_p must be in [0, 1]"),
        (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--n", "0"], "n must be an int >= 1"),
        (["--logprobs", "-1"], "logprobs must be an int >= 0"),
    ],
)
def test_bad_sampling_flags(args, message):
    """main() turns these ValueErrors into `pagedllm: error: ...` and exit status 2 (test_bad_flags)."""
    from pagedllm.entrypoints.cli import build_parser, sampling_params

    with pytest.raises(ValueError, match=re.escape(message)):
        sampling_params(build_parser().parse_args(["generate", "x", *args]))


def test_chat_takes_the_sampling_flags():
    from pagedllm.entrypoints.cli import build_parser, sampling_params

    args = [
        "chat",
        "--temperature",
        "0.7",
        "--top-k",
        "5",
        "--min-p",
        "0.1",
        "--repetition-penalty",
        "1.1",
        "--stop",
        "a",
        "--stop",
        "b",
    ]
    params = sampling_params(build_parser().parse_args(args))
    assert (params.top_k, params.min_p, params.repetition_penalty, params.stop, params.n) == (
        5,
        0.1,
        1.1,
        ["a", "b"],
        1,
    )


def test_chat_commands_change_the_conversation(capsys):
    from pagedllm.entrypoints.cli import chat_command

    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_command("/reset", "Be brief.", talk) == ("Be brief.", [{"role": "system", "content": "Be brief."}])
    assert chat_command("/system Answer in French.", "Be brief.", talk) == (
        "Answer in French.",
        [{"role": "system", "content": "Answer in French."}],
    )
    assert chat_command("/system", "Be brief.", talk) == (None, [])
    assert chat_command("/help", None, talk) == (None, talk)
    assert chat_command("/nonsense", None, talk) == (None, talk)
    assert "unknown command /nonsense" in capsys.readouterr().err


def test_chat_commands_are_not_sent_and_exit_ends_the_chat(llama_dir):
    """The tiny model has no chat template: a line sent to it would end the command with an error (status 2)."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", "--model", llama_dir, "--max-tokens", "4"]
    result = subprocess.run(command, input="/help\n/reset\nexit\nnot sent\n", capture_output=True, text=True,
                            timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "/reset forgets the conversation" in result.stderr and "(conversation forgotten)" in result.stderr
    assert result.stdout.count("> ") == 3  # /help, /reset, exit: the chat ends there


@pytest.fixture(scope="module")
def default_llm():
    """The default model's LLM, as `pagedllm` makes it without flags, for the tests that call cli.main in process."""
    from pagedllm import LLM

    llm = LLM()
    yield llm
    llm.shutdown()


def test_an_empty_answer_of_a_chat_model_points_to_chat(default_llm, monkeypatch, capsys):
    """The default model is a chat model: on this raw prompt it ends at once (greedy, so every time)."""
    from pagedllm.entrypoints import cli

    monkeypatch.setattr(cli, "make_llm", lambda args: default_llm)
    assert cli.main(["generate", "Write a short story about a robot.", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == ""
    assert 'try `pagedllm chat --message "..."`' in captured.err


def test_version_and_python_dash_m():
    version = subprocess.run([sys.executable, "-m", "pagedllm", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("pagedllm ")
    bad = subprocess.run([sys.executable, "-m", "pagedllm", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'frobnicate'" in bad.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", ""], "prompt 0 is empty"),
        (["generate", "x", ""], "prompt 1 is empty"),
        (["chat", "--message", " "], "--message is empty"),
        (["generate", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["chat", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["chat", "--message", "hi", "--max-tokens", "0"], "--max-tokens must be an int >= 1"),
    ],
)
def test_prompts_and_sampling_are_checked_before_the_model_loads(args, message, monkeypatch, capsys):
    from pagedllm.entrypoints import cli

    def no_model(args):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(cli, "make_llm", no_model)
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def chat_args(*args: str):
    from pagedllm.entrypoints.cli import build_parser

    return build_parser().parse_args(["chat", *args])


def test_chat_samples_with_the_models_generation_config_else_its_own_defaults():
    from pagedllm.entrypoints.cli import CHAT_SAMPLING, build_parser, describe_sampling, sampling_params

    qwen3_like = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    params = sampling_params(chat_args(), qwen3_like)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.0)
    params = sampling_params(chat_args("--top-k", "5"), qwen3_like)  # a flag given wins
    assert (params.temperature, params.top_k) == (0.6, 5)
    params = sampling_params(chat_args(), {})
    assert {name: getattr(params, name) for name in CHAT_SAMPLING} == CHAT_SAMPLING
    assert "(pagedllm chat's defaults: the model's generation_config sets none)" in describe_sampling(chat_args(), {})
    assert "given: --top-k" in describe_sampling(chat_args("--top-k", "5"), qwen3_like)
    # generate stays greedy whatever the model says; the interactive chat draws from the engine's stream
    assert sampling_params(build_parser().parse_args(["generate", "x"]), qwen3_like).temperature == 0
    assert sampling_params(chat_args(), {}).seed is None
    assert sampling_params(chat_args("--message", "hi", "--seed", "7"), {}).seed == 7


def test_chat_message_gives_the_same_answer_each_time(default_llm, monkeypatch, capsys):
    """The default model has no generation_config: chat samples with CHAT_SAMPLING, seeded by --seed."""
    from pagedllm.entrypoints import cli

    monkeypatch.setattr(cli, "make_llm", lambda args: default_llm)
    answers = []
    for _ in range(2):
        assert cli.main(["chat", "--message", "Tell me a story about a dragon.", "--max-tokens", "24"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and len(answers[0].split()) > 5


def test_chat_in_a_terminal_recalls_history_and_takes_its_commands(llama_dir):
    """Through a pseudo-terminal, as a user types: the up arrow brings back the last line (readline; it is not
    printed as ^[[A), /reset forgets, /exit ends the chat with status 0. Only commands are typed, so the tiny model
    (no chat template) answers nothing."""
    pexpect = pytest.importorskip("pexpect")
    command = [sys.executable, "-m", "pagedllm", "chat", "--model", llama_dir, "--max-tokens", "4"]
    child = pexpect.spawn(command[0], command[1:], env={**os.environ, "TERM": "xterm"}, encoding="utf-8", timeout=120)
    try:
        child.expect_exact("> ")
        child.send("/system Be brief.\r")
        child.expect_exact("(system prompt set; conversation started over)")
        child.expect_exact("> ")
        child.send("\x1b[A")  # the up arrow: the line above comes back, to be edited or sent again
        assert child.expect_exact(["/system Be brief.", "^[["]) == 0  # no readline: the terminal echoes ^[[A
        child.send("\r")
        child.expect_exact("(system prompt set; conversation started over)")
        child.expect_exact("> ")
        child.send("/reset\r")
        child.expect_exact("(conversation forgotten)")
        child.expect_exact("> ")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
