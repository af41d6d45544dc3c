"""Fixtures for the server tests: a tiny chat model, and `pagedllm serve` running on it in a subprocess."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")

from server_process import API_KEY, start_server, stop_server  # noqa: E402

# A minimal chat template, so the tiny model can serve /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama checkpoint with a chat template added to its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_chat_llama")
    shutil.copytree(llama_dir, directory, dirs_exist_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    running = start_server(chat_model_dir, log_path, "--max-model-len", "512", "--api-key", API_KEY)
    yield running
    status = stop_server(running, signal.SIGTERM)
    assert status == 0, f"SIGTERM should end the server with status 0, got {status}:\n{running.log()}"
    assert "Traceback" not in running.log(), running.log()
