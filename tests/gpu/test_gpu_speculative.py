"""Speculative decoding (n-gram) on a CUDA GPU, as it runs there by default: Triton attention, CUDA graphs (verify
steps are prompt-shaped steps: they replay the prefill graphs), async scheduling; greedy and seeded outputs equal
those without speculation, and the sample rows past max_num_seqs fit the step buffers. A draft model is refused."""

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


def test_a_draft_model_on_cuda_is_refused(llama_dir):
    with pytest.raises(ValueError, match="CPU only"):
        LLM(llama_dir, speculative_config={"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2})
