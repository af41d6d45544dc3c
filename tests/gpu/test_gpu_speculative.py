"""Speculative decoding (n-gram) on a CUDA GPU, as it runs there by default: Triton attention, CUDA graphs (verify
steps are prompt-shaped steps: they replay the prefill graphs), async scheduling; greedy and seeded outputs equal
those without speculation, and the sample rows past max_num_seqs fit the step buffers; a draft model runs beside
the target in the memory the target's cache leaves it."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SMALL = dict(num_kv_blocks=1024, max_num_seqs=8, dtype="float32")
PARAMS = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=10, seed=3, max_tokens=32, ignore_eos=True)]  # fmt: skip


def copy_heavy_prompts() -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(4, 16))] * 3}
            for _ in range(8)]  # fmt: skip


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_ngram_speculation_on_cuda_changes_no_greedy_or_seeded_token(llama_dir, enforce_eager):
    prompts = copy_heavy_prompts()
    plain = LLM(llama_dir, enforce_eager=enforce_eager, **SMALL)
    speculating = LLM(llama_dir, enforce_eager=enforce_eager, speculative_config=NGRAM, **SMALL)
    records = []
    speculating.llm_engine.add_step_listener(records.append)
    for params in PARAMS:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in speculating.generate(prompts, params, use_tqdm=False)] == expected
    assert sum(r.num_accepted_tokens for r in records) > 0
    assert max(r.num_sampled for r in records) > SMALL["max_num_seqs"]  # more sample rows than sequences
    block_manager = speculating.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    plain.shutdown()
    speculating.shutdown()


def test_a_draft_model_on_cuda_changes_no_greedy_token_and_fits_beside_the_cache(llama_dir):
    """The target as its own draft, on CUDA with graphs and async scheduling: greedy outputs equal the plain run's
    and nearly every draft is kept; sampled drafts (seeded, temperature 0.8) complete and repeat. The target's cache
    is sized from free memory (gpu_memory_utilization), so the draft's blocks, weights and activations must have been
    left free beside it (else its start or its steps run out of memory); every block is free again at the end."""
    prompts = copy_heavy_prompts()
    draft = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3}
    plain = LLM(llama_dir, max_num_seqs=8, dtype="float32", gpu_memory_utilization=0.5)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS[0], use_tqdm=False)]
    plain.shutdown()
    speculating = LLM(llama_dir, max_num_seqs=8, dtype="float32", gpu_memory_utilization=0.5, speculative_config=draft)
    records = []
    speculating.llm_engine.add_step_listener(records.append)
    assert [o.outputs[0].token_ids for o in speculating.generate(prompts, PARAMS[0], use_tqdm=False)] == expected
    proposed, accepted = sum(r.num_draft_tokens for r in records), sum(r.num_accepted_tokens for r in records)
    assert proposed > 0 and accepted >= 0.95 * proposed, (proposed, accepted)
    sampled = [[o.outputs[0].token_ids for o in speculating.generate(prompts, PARAMS[1], use_tqdm=False)]
               for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1] and all(len(tokens) == 32 for tokens in sampled[0])
    block_manager = speculating.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
    speculating.shutdown()
