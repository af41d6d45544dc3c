"""Tensor parallelism on two GPUs (NCCL, run with `pytest -m gpu tests/gpu` on a 2-GPU machine): TP=2 gives TP=1's
greedy tokens in float32 and transformers' first tokens and logits in bf16, with CUDA graphs (NCCL inside them)
and async scheduling on; graphs on and off agree; prefix caching, chunking and preemption change nothing."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE, capture_logits, local_worker
from test_gpu_engine import SMALL, assert_bf16_prefill_matches_transformers, prompts, reference_greedy, tokens

from pagedllm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (run on a 2-GPU machine)"),
]


def parallel_llm(directory: str, **kwargs) -> LLM:
    """One tensor-parallel engine at a time per process: use it in a `with` block."""
    return LLM(directory, tensor_parallel_size=2, **{**SMALL, **kwargs})


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3"])
def test_float32_greedy_equals_transformers(tiny_model_dirs, name):
    batch = prompts()
    with parallel_llm(tiny_model_dirs[name], dtype="float32") as llm:
        executor = llm.llm_engine.worker
        assert local_worker(llm).graphs is not None and llm.llm_engine.async_scheduling
        assert max(executor.weight_bytes_per_rank) < 0.6 * sum(executor.weight_bytes_per_rank)
        assert tokens(llm, batch) == reference_greedy(tiny_model_dirs[name], torch.float32, batch)


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3"])
def test_bfloat16_logits_and_first_tokens_match_transformers(tiny_model_dirs, name):
    """The one-GPU test's tolerance: prefill logits within 2e-2 relative, first tokens equal."""
    batch = prompts()
    with parallel_llm(tiny_model_dirs[name], dtype="bfloat16") as llm:
        captured = capture_logits(llm)  # rank 0's model: its compute_logits returns the gathered logits
        ours = tokens(llm, batch)
    assert_bf16_prefill_matches_transformers(tiny_model_dirs[name], batch, captured[0], ours)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graphs_change_nothing(tiny_model_dirs, dtype):
    with parallel_llm(tiny_model_dirs["qwen3"], dtype=dtype, enforce_eager=True) as llm:
        eager = tokens(llm, prompts(1))
    with parallel_llm(tiny_model_dirs["qwen3"], dtype=dtype) as llm:
        assert local_worker(llm).graphs is not None
        assert tokens(llm, prompts(1)) == eager


def test_caching_chunking_and_preemption_change_nothing(tiny_model_dirs):
    """Eight 15-token prompts twice (the second time from the prefix cache), in 7-token chunks, with room for only
    some of their second blocks: float32, so exact."""
    rng = random.Random(2)
    batch = [{"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(15)]} for _ in range(8)]
    expected = tokens(LLM(tiny_model_dirs["qwen3"], dtype="float32", **SMALL), batch)
    settings = dict(dtype="float32", num_kv_blocks=10, max_num_batched_tokens=7, enable_prefix_caching=True)
    with parallel_llm(tiny_model_dirs["qwen3"], **settings) as llm:
        assert tokens(llm, batch) == expected
        assert tokens(llm, batch) == expected
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert llm.llm_engine.block_manager.num_free_blocks == 10
