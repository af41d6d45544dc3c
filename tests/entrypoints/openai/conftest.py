"""Fixtures the server tests share: the tiny Llama checkpoint with a chat template."""

from __future__ import annotations

import json
import shutil

import pytest

# A minimal chat template, so the tiny model can serve /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}{% if message['name'] %} {{ message['name'] }}{% endif %}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
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
