"""Every user mistake is a clear error before anything is scheduled, and the engine keeps serving afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams

GOOD = {"prompt_token_ids": [5, 6, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=64, num_kv_blocks=32, block_size=16)


def assert_still_serving(llm: LLM) -> None:
    output = llm.generate(GOOD, GREEDY, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "non-empty"),
        ({"prompt_token_ids": [5, VOCAB_SIZE]}, f"outside the vocabulary [0, {VOCAB_SIZE})"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": [5] * 64}, "64 tokens, but max_model_len is 64"),
        ({"prompt_token_ids": [5] * 100}, "100 tokens, but max_model_len is 64"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_keeps_serving(llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        llm.generate([GOOD, prompt], GREEDY, use_tqdm=False)
    assert_still_serving(llm)


def test_wrong_prompt_type_is_a_type_error(llm):
    with pytest.raises(TypeError, match="a prompt is a str or a dict"):
        llm.generate([42], GREEDY, use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(top_k=-2), "top_k must be an int >= -1"),
        (dict(max_tokens=0), "max_tokens must be an int >= 1"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(seed=2**64), "seed must be an int"),
        (dict(n=2), "only n=1"),
    ],
)
def test_bad_sampling_params(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert_still_serving(llm)


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate([GOOD] * 3, [GREEDY, GREEDY], use_tqdm=False)
    assert_still_serving(llm)


def test_request_that_can_never_fit_the_cache(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV cache holds only 2 blocks"):
        llm.generate({"prompt_token_ids": [5] * 40}, GREEDY, use_tqdm=False)
    assert_still_serving(llm)


def test_generation_stops_at_max_model_len(llm):
    output = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(temperature=0, max_tokens=None), False)[0]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 64


def test_stop_token_ids_finish_with_stop(llm):
    first = llm.generate(GOOD, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first])
    output = llm.generate(GOOD, params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == [first] and output.finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(gpu_memory_utilisation=0.5), TypeError, "unknown LLM argument"),
        (dict(block_size=24), ValueError, "power of two"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs must be a positive int"),
        (dict(dtype="int8"), ValueError, "dtype must be"),
        (dict(max_model_len=10**6), ValueError, "exceeds the model's limit of 1024"),
        (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size"),
    ],
)
def test_bad_engine_arguments(llama_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(llama_dir, **kwargs)


def test_missing_model_path():
    with pytest.raises(ValueError, match="neither a Hugging Face model directory nor a .gguf file"):
        LLM("/nonexistent/model")


def copy_model(source: str, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def test_unsupported_architecture_lists_supported(llama_dir, tmp_path):
    directory = copy_model(llama_dir, tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture.*supported: LlamaForCausalLM"):
        LLM(str(directory))


def test_missing_and_unexpected_weights_are_named(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = copy_model(llama_dir, tmp_path / "model")
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: model.layers.1.self_attn.qkv_proj.weight \[k\]"):
        LLM(str(directory))
    weights["model.layers.1.self_attn.k_proj.weight"] = weights["model.layers.0.self_attn.k_proj.weight"].clone()
    weights["model.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        LLM(str(directory))
