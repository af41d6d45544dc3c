"""The C++ decode stack (models/cpu_decode_stack.py) computes what the layers' modules compute, to the bit: in one
engine, every logits row of a run with the stack taking the decode and verify steps equals the same run's with the
modules taking them, for each tiny family (GQA, tied heads, q/k norms, qkv biases), bfloat16, GGUF blocks kept,
n = 2 and n-gram verify steps; and where the stack cannot take the model, the modules run and the reason is kept."""

from __future__ import annotations

import pytest
import torch
from conftest import capture_logits, local_worker
from loader.test_gguf_loader import tiny_weights, write_tiny_gguf
from spec_decode.test_spec_engine import NGRAM, copy_heavy_prompts

from pagedllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6 + [5, 6]}, {"prompt_token_ids": list(range(20, 61))}]


class CountingStack:
    """The model's stack, counting the steps it took (decode-only ones and the others: verify steps)."""

    def __init__(self, stack):
        self.stack, self.decode_steps, self.other_steps = stack, 0, 0

    def __call__(self, hidden, positions, metadata):
        result = self.stack(hidden, positions, metadata)
        if result is not None:
            if metadata.decode_only:
                self.decode_steps += 1
            else:
                self.other_steps += 1
        return result


def stack_and_modules(
    llm: LLM, params: SamplingParams, prompts: list[dict] = PROMPTS
) -> tuple[list[torch.Tensor], list[torch.Tensor], CountingStack]:
    """Each step's logits with the stack, then with the modules, over the same requests."""
    model = local_worker(llm).model.model
    assert model.decode_stack is not None, "the CPU kernel choices take the decode stack"
    counting = CountingStack(model.decode_stack)
    captured = capture_logits(llm)
    runs = []
    for stack in (counting, None):
        model.decode_stack = stack
        llm.generate(prompts, params, use_tqdm=False)
        runs.append(list(captured))
        captured.clear()
    model.decode_stack = counting.stack
    return runs[0], runs[1], counting


def assert_bit_equal(with_stack: list[torch.Tensor], with_modules: list[torch.Tensor]) -> None:
    assert len(with_stack) == len(with_modules)
    for step, (a, b) in enumerate(zip(with_stack, with_modules)):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {(a.float() - b.float()).abs().max()}"


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("name", ["llama_gqa_untied", "llama3_rope_tied", "qwen3", "qwen2_bias", "mistral"])
def test_the_stack_computes_the_modules_logits_to_the_bit(tiny_model_dirs, name):
    llm = LLM(tiny_model_dirs[name], device="cpu", dtype="float32", skip_tokenizer_init=True)
    with_stack, with_modules, counting = stack_and_modules(llm, GREEDY)
    assert_bit_equal(with_stack, with_modules)
    assert counting.decode_steps == GREEDY.max_tokens - 1  # every step after the prompts' own


def test_bfloat16_two_samples_a_request(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"], device="cpu", dtype="bfloat16", skip_tokenizer_init=True)
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    with_stack, with_modules, counting = stack_and_modules(llm, params)
    assert_bit_equal(with_stack, with_modules)
    assert counting.decode_steps > 0


def test_verify_steps_of_ngram_speculation(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama_gqa_untied"], device="cpu", skip_tokenizer_init=True, speculative_config=NGRAM)
    with_stack, with_modules, counting = stack_and_modules(llm, GREEDY, copy_heavy_prompts(4))
    assert_bit_equal(with_stack, with_modules)
    assert counting.other_steps > 0  # steps of several rows a sequence went through the stack


def test_gguf_blocks_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_weights("llama", 16, tied=False), 16)
    llm = LLM(str(path), device="cpu", skip_tokenizer_init=True)
    assert llm.llm_engine.resolved.kernels.quantization == "gguf"
    with_stack, with_modules, counting = stack_and_modules(llm, GREEDY)
    assert_bit_equal(with_stack, with_modules)
    assert counting.decode_steps == GREEDY.max_tokens - 1


def test_a_cache_the_stack_cannot_take_leaves_the_modules_running(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama_gqa_untied"], device="cpu", skip_tokenizer_init=True, kv_cache_dtype="fp8")
    model = local_worker(llm).model.model
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) == GREEDY.max_tokens for output in outputs)
    assert model.decode_stack.stack is None
    assert "KV cache holds torch.float8_e4m3fn" in model.decode_stack.reason
