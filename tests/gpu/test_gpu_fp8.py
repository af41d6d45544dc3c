"""The engine with an fp8 KV cache on a CUDA GPU (run there with `pytest -m gpu tests/gpu`): the Triton fp8 path
follows float32 transformers except at near ties, and graphs, caching, chunking and preemption change nothing."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE
from test_gpu_engine import SMALL, prompts, tokens
from transformers import AutoModelForCausalLM

from pagedllm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]
NEAR_TIE = 0.15  # as tests/engine/test_fp8_kv_cache.py: below the tiny checkpoints' median top-2 logit gap


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3"])
def test_fp8_greedy_follows_float32_except_at_near_ties(tiny_model_dirs, name):
    batch = prompts()
    llm = LLM(tiny_model_dirs[name], dtype="float32", kv_cache_dtype="fp8", **SMALL)
    assert llm.llm_engine.worker.backend.name == "triton"
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[name], dtype=torch.float32).cuda().eval()
    for prompt, output in zip(batch, tokens(llm, batch)):
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():  # teacher-forced on fp8's own output
            logits = reference(torch.tensor([ids + output], device="cuda")).logits[0, len(ids) - 1 : -1]
        gaps = logits.max(-1).values - logits[torch.arange(len(output)), torch.tensor(output)]
        assert (gaps < NEAR_TIE).all(), f"prompt of {len(ids)} tokens: gaps {gaps.tolist()}"


def fp8_eager_tokens(tiny_model_dirs, batch):
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32", kv_cache_dtype="fp8", enforce_eager=True,
              enable_prefix_caching=False, **SMALL)  # fmt: skip
    return tokens(llm, batch)


def short_prompts() -> list[dict]:
    """Eight 15-token prompts fit one block each; their 16 new tokens need a second block that only some get."""
    rng = random.Random(2)
    return [{"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(15)]} for _ in range(8)]


@pytest.mark.parametrize(
    ("kwargs", "make_batch"),
    [
        (dict(), prompts),  # CUDA graphs against eager
        (dict(enable_prefix_caching=True), prompts),
        (dict(max_num_batched_tokens=7, block_size=32), prompts),
        (dict(num_kv_blocks=10), short_prompts),  # preemption
    ],
)
def test_fp8_graphs_caching_chunking_preemption_change_nothing(tiny_model_dirs, kwargs, make_batch):
    batch = make_batch()
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32", kv_cache_dtype="fp8", **{**SMALL, **kwargs})
    assert llm.llm_engine.worker.graphs is not None
    assert tokens(llm, batch) == fp8_eager_tokens(tiny_model_dirs, batch)
    if "num_kv_blocks" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0
