"""DecoderSpec.num_parameters (what a draft model's weights take on the device, set aside before the target's cache
is sized) counts what transformers builds from the same config: tied and untied heads, qkv biases, q/k norms."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.models.spec import DecoderSpec


@pytest.mark.parametrize("name", ["llama_gqa_untied", "llama3_rope_tied", "qwen3", "qwen2_bias", "mistral"])
def test_num_parameters_is_transformers_count(tiny_model_dirs, name):
    directory = tiny_model_dirs[name]
    model = AutoModelForCausalLM.from_pretrained(directory)
    spec = DecoderSpec.from_hf_config(AutoConfig.from_pretrained(directory))
    assert spec.num_parameters() == sum(parameter.numel() for parameter in model.parameters())
