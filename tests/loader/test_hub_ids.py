"""A Hugging Face repo id as the model: resolved through huggingface_hub's cache, offline here (a checkpoint placed in
the cache's layout in a temp dir); without it in the cache and without network, an error that says what to run."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loader.checkpoint import is_hub_id

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty HF cache in tmp_path, with the hub unreachable as far as huggingface_hub is concerned."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def place_in_cache(cache, repo_id: str, source: str) -> None:
    """The files of `source` as the snapshot the cache's refs/main names (the layout huggingface_hub writes)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)


def test_a_hub_id_in_the_cache_loads_offline(llama_dir, offline_cache):
    place_in_cache(offline_cache, "tiny-org/tiny-llama", llama_dir)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama").generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    by_path = LLM(llama_dir).generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


def test_a_hub_id_neither_cached_nor_reachable_says_what_to_run(offline_cache):
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache .* run `hf download tiny-org/absent`"):
        LLM("tiny-org/absent")


def test_what_counts_as_a_hub_id():
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name")
    assert not any(map(is_hub_id, ["name", "./org/name", "~/org/name", "/org/name", "a/b/c", "org/model.gguf"]))
