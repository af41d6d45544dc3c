"""A draft model must share the target's tokenizer: start-up refuses one that does not, saying what differs."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import make_config, train_tokenizer
from transformers import AutoModelForCausalLM

from pagedllm import LLM


def draft(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 2}


def test_a_draft_of_another_vocabulary_size_is_refused(llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_config(make_config("llama", dict(num_key_value_heads=2, vocab_size=512)))
    model.save_pretrained(tmp_path)
    train_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target 384; a draft model must share"):
        LLM(llama_dir, speculative_config=draft(str(tmp_path)))


def test_a_draft_with_another_tokenizer_is_refused(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = "a", "b"
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two ids swapped
    tokenizer_file.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="has another tokenizer than the target"):
        LLM(llama_dir, speculative_config=draft(str(tmp_path)))


def test_a_missing_draft_checkpoint_is_named(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        LLM(llama_dir, speculative_config=draft(str(tmp_path / "nowhere")))
