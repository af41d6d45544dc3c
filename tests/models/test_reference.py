"""Every model family against transformers on the same tiny random weights, float32 on CPU:
greedy tokens equal generate(do_sample=False), last-position logits equal within 1e-4 relative."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, VOCAB_SIZE, capture_logits
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

PROMPT_LENGTHS = [1, 3, 15, 16, 17, 40, 130, 300]
NEW_TOKENS = 12


def random_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS]


def transformers_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        last_logits = model(input_ids).logits[0, -1]
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return generated[0, len(prompt) :].tolist(), last_logits


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_matches_transformers(tiny_model_dirs, name):
    directory = tiny_model_dirs[name]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = random_prompts()
    llm = LLM(directory, block_size=16, max_num_batched_tokens=4096)
    captured = capture_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    first_step_logits = captured[0]  # one batched prefill: row i is prompt i's last position
    assert first_step_logits.shape[0] == len(prompts)
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        expected_tokens, expected_logits = transformers_greedy(reference, prompt)
        assert output.outputs[0].token_ids == expected_tokens, f"prompt of {len(prompt)} tokens"
        error = (first_step_logits[index] - expected_logits).norm() / expected_logits.norm()
        assert error < 1e-4, f"prompt of {len(prompt)} tokens: relative logits error {error:.2e}"


def test_sharded_checkpoint_loads_like_one_file(tiny_model_dirs, tmp_path):
    """model.safetensors.index.json with several shards gives the same model as the single file."""
    directory = tiny_model_dirs["llama_gqa_untied"]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((Path(directory) / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts()[:3]]
    one_file = LLM(directory).generate(prompts, params, use_tqdm=False)
    shards = LLM(str(sharded)).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in shards] == [o.outputs[0].token_ids for o in one_file]
