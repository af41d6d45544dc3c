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


def place_gguf_repo(cache, repo_id: str, names: list[str]) -> None:
    """A GGUF repository in the cache: a README and these .gguf files (each the embedded default model, linked)."""
    from pagedllm.loader.default_model import default_model_path

    snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("GGUF quantizations")
    for name in names:
        (snapshot / name).symlink_to(default_model_path())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REVISION)


def test_a_gguf_repository_with_one_gguf_file_loads_it(offline_cache):
    from pagedllm.loader.checkpoint import open_checkpoint

    place_gguf_repo(offline_cache, "org/smol-gguf", ["smol.Q4_1.gguf"])
    checkpoint = open_checkpoint("org/smol-gguf", load_tokenizer=False, write_cache=False)
    assert checkpoint.source.endswith(f"{REVISION}/smol.Q4_1.gguf")
    assert checkpoint.hf_config.num_hidden_layers == 30  # SmolLM2-135M, read from the GGUF's metadata


def test_a_gguf_repository_with_several_files_takes_gguf_file(offline_cache):
    from pagedllm.loader.checkpoint import model_path

    place_gguf_repo(offline_cache, "org/quants", ["m.Q4_1.gguf", "m.Q8_0.gguf"])
    with pytest.raises(ValueError, match=r"holds 2 .gguf files \(m.Q4_1.gguf, m.Q8_0.gguf\); pick one with gguf_file"):
        model_path("org/quants")
    assert model_path("org/quants", gguf_file="m.Q8_0.gguf").name == "m.Q8_0.gguf"
    with pytest.raises(ValueError, match=r"gguf_file='m.F16.gguf' is not in model 'org/quants'; its .gguf files: m"):
        model_path("org/quants", gguf_file="m.F16.gguf")


def test_a_local_directory_of_gguf_files_and_the_flag(offline_cache, tmp_path, capsys):
    """The same choice for a local directory; on the command line the error names --gguf-file, before any load."""
    from pagedllm.entrypoints.cli import main
    from pagedllm.loader.checkpoint import model_path

    (tmp_path / "quants").mkdir()
    for name in ("m.Q4_1.gguf", "m.Q8_0.gguf"):
        (tmp_path / "quants" / name).write_bytes(b"")
    assert model_path(tmp_path / "quants", gguf_file="m.Q4_1.gguf") == tmp_path / "quants" / "m.Q4_1.gguf"
    assert main(["generate", "x", "--model", str(tmp_path / "quants")]) == 2
    assert "holds 2 .gguf files (m.Q4_1.gguf, m.Q8_0.gguf); pick one with --gguf-file=NAME" in capsys.readouterr().err
    with pytest.raises(ValueError, match="picks a .gguf file of a directory or hub repository"):
        model_path(tmp_path / "quants" / "m.Q4_1.gguf", gguf_file="m.Q4_1.gguf")
