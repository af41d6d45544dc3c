"""FP8 checkpoints load by dequantizing: tiny checkpoints with block, per-row and per-tensor scales give the model
that transformers builds from the dequantized weights (greedy tokens equal, logits within float32 tolerance), and a
tensor-parallel shard of a weight reads exactly that part of the dequantized weight."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB_SIZE, write_tiny_model
from fp8_checkpoints import write_fp8_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.loader.fp8_checkpoint import Fp8Format, fp8_format


@pytest.mark.parametrize("scheme", ["block", "row", "tensor"])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, scheme):
    write_tiny_model(tmp_path / "reference", "llama_gqa_untied")
    write_fp8_checkpoint(tmp_path / "reference", tmp_path / "fp8", scheme)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    prompts = [[(7 * i + 3 * j) % (VOCAB_SIZE - 2) + 2 for j in range(5 + 9 * i)] for i in range(4)]
    llm = LLM(str(tmp_path / "fp8"), max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            generated = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=0)
        assert output.outputs[0].token_ids == generated[0, len(prompt) :].tolist()
    llm.shutdown()


def test_a_shard_reads_that_part_of_the_dequantized_weight(tmp_path):
    """Narrowed as a tensor-parallel rank narrows it (rows of a column-parallel layer, columns of a row-parallel
    one), across block edges and into the ragged last block."""
    write_tiny_model(tmp_path / "reference", "llama_gqa_untied")
    write_fp8_checkpoint(tmp_path / "reference", tmp_path / "fp8", "block", block=(24, 40))
    dequantized = load_file(tmp_path / "reference" / "model.safetensors")
    checkpoint = open_checkpoint(str(tmp_path / "fp8"), load_tokenizer=False)
    tensors = dict(checkpoint.named_tensors(torch.float32))
    assert not any(name.endswith(("_scale", "_scale_inv", "input_scale")) for name in tensors)
    name = "model.layers.0.mlp.gate_proj.weight"  # [128, 64]
    full = dequantized[name]
    for dim, start, length in [(0, 0, 128), (0, 20, 50), (0, 100, 28), (1, 30, 34), (1, 0, 40), (1, 41, 1)]:
        assert torch.equal(tensors[name].narrow(dim, start, length).read(), full.narrow(dim, start, length))


def test_fp8_format_errors_name_the_problem(tmp_path):
    class Config:
        quantization_config = {"quant_method": "awq"}

    with pytest.raises(ValueError, match="'awq' is not supported"):
        fp8_format(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128]}
    with pytest.raises(ValueError, match="weight_block_size must be two positive ints"):
        fp8_format(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert fp8_format(Config()) == Fp8Format((128, 128))


def test_scales_of_the_wrong_shape_are_refused(tmp_path):
    write_tiny_model(tmp_path / "reference", "llama_gqa_untied")
    write_fp8_checkpoint(tmp_path / "reference", tmp_path / "fp8", "block", block=(32, 48))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]  # the scales were made for 32 x 48 blocks
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs scales of shape"):
        LLM(str(tmp_path / "fp8"))
