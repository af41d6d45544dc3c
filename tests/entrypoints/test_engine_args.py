"""Every command's engine flags come from EngineConfig (one flag per field, EngineConfig's defaults), reach the
engine, and errors about them name the flag."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import httpx
import pytest
import torch

from pagedllm.config import FIELD_RULES, EngineConfig
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.engine_args import EXCLUDED, engine_kwargs, flag, name_flags

COMMANDS = ("chat", "generate", "serve", "bench")
FIELDS = {field.name: field for field in dataclasses.fields(EngineConfig)}


def option_strings(command: str) -> set[str]:
    commands = next(action for action in build_parser()._actions if action.dest == "command")
    return {option for action in commands.choices[command]._actions for option in action.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_a_flag_for_every_engine_field_but_the_excluded(command):
    """The four commands' engine flags are EngineConfig's fields, less the ones EXCLUDED names with a reason;
    each defaults to EngineConfig's default, so giving no flag is LLM()'s defaults."""
    defaults = vars(build_parser().parse_args([command]))
    expected = set(FIELDS) - set(EXCLUDED.get(command, {}))
    assert set(defaults) & set(FIELDS) == expected
    assert {name: defaults[name] for name in expected} == {name: FIELDS[name].default for name in expected}
    options = option_strings(command)
    assert {name for name in FIELDS if flag(name) in options} == expected
    booleans = {name for name in expected if bool in FIELD_RULES[name].types}
    assert {name for name in booleans if f"--no-{flag(name)[2:]}" in options} == booleans


def test_the_exclusions_are_engine_fields_and_give_a_reason():
    assert set(EXCLUDED) <= set(COMMANDS)
    for excluded in EXCLUDED.values():
        assert set(excluded) <= set(FIELDS) and all(excluded.values())


def test_the_commands_take_the_same_engine_flags_as_before():
    """serve keeps its engine flags and defaults (--max-num-seqs 256 ...); chat/generate and bench keep theirs."""
    serve = build_parser().parse_args(["serve"])
    assert (serve.max_num_seqs, serve.max_num_batched_tokens, serve.max_model_len, serve.skip_tokenizer_init) == (
        256,
        None,  # 8192 on a GPU, 2048 on a CPU (the engine resolves it)
        None,
        False,
    )
    bench = build_parser().parse_args(
        ["bench", "--enforce-eager", "--block-size", "32", "--gpu-memory-utilization", "0.5"]
    )
    assert (bench.enforce_eager, bench.block_size, bench.gpu_memory_utilization) == (True, 32, 0.5)
    chat = build_parser().parse_args(["chat", "--trace-file", "t.json", "--trace-kv-every", "4", "--seed", "3"])
    assert (chat.trace_file, chat.trace_kv_every, chat.seed) == ("t.json", 4, 3)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["chat", "--max-model-len", "2048"], dict(max_model_len=2048)),
        (["serve", "--kv-cache-dtype", "fp8"], dict(kv_cache_dtype="fp8")),
        (["generate", "x", "--no-enable-prefix-caching", "--async-scheduling"], dict(enable_prefix_caching=False,
                                                                                  async_scheduling=True)),
        (["serve", "--gpu-memory-utilization", "0.5", "--attention-backend", "torch"],
         dict(gpu_memory_utilization=0.5, attention_backend="torch")),
        (["bench", "--num-kv-blocks", "100", "--dtype", "float16"], dict(num_kv_blocks=100, dtype="float16")),
        (["generate", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
         dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')),
    ],
)  # fmt: skip
def test_flags_parse_into_the_engine_config(args, expected):
    parsed = build_parser().parse_args(args)
    config = EngineConfig(**engine_kwargs(parsed, parsed.command))
    assert config == EngineConfig(**expected)


def run_main(capsys, *args: str) -> str:
    """main() in this process (torch's thread count unchanged); its stderr."""
    assert main([*args, "--threads", str(torch.get_num_threads())]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "x", "--max-model-len", "0"], "--max-model-len must be a positive int or None, got 0"),
        (["generate", "x", "--max-tokens", "0"], "--max-tokens must be an int >= 1"),
        (["chat", "--top-p", "0"], "--top-p must be"),
        (["chat", "--seed", "-1"], "--seed must be an int from 0 to 2**64 - 1"),
        (["chat", "--trace-kv-every", "2"], "--trace-kv-every needs --trace-file"),
        (["generate", "x", "--device", "cpu", "--attention-backend", "triton"], "--attention-backend='triton' needs"),
        (["serve", "--kv-cache-dtype", "fp16"], "--kv-cache-dtype must be one of ('auto', 'fp8'), got 'fp16'"),
        (["serve", "--block-size", "24"], "--block-size must be a power of two"),
    ],
)
def test_errors_name_the_flag_not_the_field(capsys, args, message):
    err = run_main(capsys, *args)
    assert f"pagedllm: error: {message}" in err
    assert "Traceback" not in err


def test_errors_of_the_engine_at_start_up_and_per_request_name_the_flag(capsys, llama_dir):
    err = run_main(capsys, "generate", "x", "--model", llama_dir, "--max-model-len", "5000")
    assert "--max-model-len=5000 exceeds the model's limit of 1024" in err
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    err = run_main(capsys, "generate", long_prompt, "--model", llama_dir, "--max-model-len", "8")
    assert "but --max-model-len is 8" in err  # the flag reached the engine


def test_name_flags_leaves_words_that_are_not_settings():
    names = ["model", "max_model_len", "n", "seed"]
    assert name_flags("model '/x' is neither a directory", names) == "model '/x' is neither a directory"
    assert (
        name_flags("max_model_len=9 exceeds the model's limit", names) == "--max-model-len=9 exceeds the model's limit"
    )
    assert name_flags("n must be an int >= 1; seed + n - 1 must be <= 9", names) == (
        "--n must be an int >= 1; seed + n - 1 must be <= 9"
    )
    assert name_flags("min_tokens must be <= max_tokens=3", ["max_tokens"]) == "min_tokens must be <= --max-tokens=3"


def test_serve_with_an_fp8_kv_cache(llama_dir, tmp_path):
    pytest.importorskip("fastapi", reason="the server needs the serve extra")
    from server_process import start_server, stop_server

    server = start_server(llama_dir, tmp_path / "server.log", "--kv-cache-dtype", "fp8", "--max-model-len", "128")
    try:
        body = {"model": llama_dir, "prompt": "The quick brown", "max_tokens": 3, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        assert "GiB, fp8)" in server.log()  # the start-up log line names the cache dtype
    finally:
        assert stop_server(server) == 0


@pytest.mark.parametrize(
    ("module", "not_imported"),
    [
        ("pagedllm.entrypoints.bench", ["pagedllm.entrypoints.cli", "pagedllm.entrypoints.bench_latency"]),
        ("pagedllm.entrypoints.bench_latency", ["pagedllm.entrypoints.cli", "pagedllm.entrypoints.bench"]),
    ],
)
def test_the_bench_commands_import_the_shared_code_not_each_other_or_the_cli(module, not_imported):
    code = f"import sys, {module}; print([name for name in {not_imported!r} if name in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
