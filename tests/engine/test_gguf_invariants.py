"""The invariants of test_invariants.py under the GGUF method (blocks kept quantized, the default for a GGUF file on
CPU): greedy output does not change with prefix caching, chunk size, preemption or batch composition, and no block
stays held. A tiny Llama GGUF file (Q8_0 weights, kept as two int4 halves) written here."""

from __future__ import annotations

import random

import pytest
from loader.test_gguf_loader import TOKENS, tiny_weights, write_tiny_gguf

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_weights("llama", 16, tied=False), 16)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    rng = random.Random(3)
    shared = [rng.randrange(len(TOKENS) - 3) for _ in range(40)]
    tails = [[rng.randrange(len(TOKENS) - 3) for _ in range(rng.randrange(1, 50))] for _ in range(8)]
    return [{"prompt_token_ids": (shared if index % 2 else []) + tail} for index, tail in enumerate(tails)]


def engine(path: str, **kwargs) -> LLM:
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", **kwargs)
    assert llm.llm_engine.resolved.kernels.quantization == "gguf"  # kept quantized: the default here
    return llm


def greedy_tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    block_manager = llm.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks  # nothing held once every request ended
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_gguf, prompts) -> list[list[int]]:
    return greedy_tokens(engine(tiny_gguf, enable_prefix_caching=False, max_num_batched_tokens=4096), prompts)


def test_prefix_caching_and_batch_composition_change_nothing(tiny_gguf, prompts, baseline):
    llm = engine(tiny_gguf)
    assert greedy_tokens(llm, prompts) == baseline
    assert greedy_tokens(llm, prompts) == baseline  # served mostly from the prefix cache
    assert [greedy_tokens(llm, [prompt])[0] for prompt in prompts[:3]] == baseline[:3]


def test_chunks_and_preemption_change_nothing(tiny_gguf, prompts, baseline):
    longest = max(len(prompt["prompt_token_ids"]) for prompt in prompts) + GREEDY.max_tokens
    llm = engine(tiny_gguf, max_num_batched_tokens=7, num_kv_blocks=-(-longest // 16))
    assert greedy_tokens(llm, prompts) == baseline
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_the_float32_copy_on_disk_is_written_only_to_dequantize(tiny_gguf, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    engine(tiny_gguf)
    assert sorted(entry.name.split("-")[1] for entry in tmp_path.iterdir()) == ["index"]  # no tokenizer asked for
    llm = LLM(tiny_gguf, skip_tokenizer_init=True, device="cpu", quantization=None)
    assert llm.llm_engine.resolved.kernels.quantization is None
    assert sorted(entry.name.split("-")[1] for entry in tmp_path.iterdir()) == ["float32", "index"]
    assert len(greedy_tokens(llm, prompts[:2])) == 2
