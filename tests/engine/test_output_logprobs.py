"""CompletionOutput.logprobs, cumulative_logprob and RequestOutput.prompt_logprobs equal transformers' log-softmax on
the same weights (float32, abs 1e-4), with the right ranks and the chosen token always present: in a mixed batch,
with chunked prefill, with async scheduling, with prefix-cache hits, and for each sample of n > 1."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import VOCAB_SIZE
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import PositionLogprobs

TOLERANCE = 1e-4
rng = random.Random(5)
SHARED = [rng.randrange(2, VOCAB_SIZE) for _ in range(40)]
PROMPTS = [SHARED + [rng.randrange(2, VOCAB_SIZE) for _ in range(length)] for length in (1, 9, 30)]
PROMPTS.append([rng.randrange(2, VOCAB_SIZE) for _ in range(3)])
REQUESTS = [
    SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0),
    # Penalties, bias and truncation change the sampled tokens, never the (raw) logprobs.
    SamplingParams(top_k=3, repetition_penalty=1.5, logit_bias={7: 4.0}, seed=2, max_tokens=6, ignore_eos=True,
                   logprobs=2),
    SamplingParams(n=2, seed=3, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=VOCAB_SIZE),
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: row p holds the log-probabilities of the token after position p."""
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return log_softmax


def check_position(entry: PositionLogprobs, row: torch.Tensor, chosen: int, num_top: int) -> None:
    """The chosen token with its logprob and rank, and the row's top num_top tokens ranked 1, 2, ..."""
    assert chosen in entry
    assert abs(entry[chosen].logprob - row[chosen].item()) < TOLERANCE
    rank_low = 1 + int((row > row[chosen] + TOLERANCE).sum())  # ranks within the tolerance of float noise
    rank_high = 1 + int((row > row[chosen] - TOLERANCE).sum())
    assert rank_low <= entry[chosen].rank <= rank_high
    top_logprobs, top_ids = row.topk(num_top)
    for rank, (token_id, logprob) in enumerate(zip(top_ids.tolist(), top_logprobs.tolist()), 1):
        assert entry[token_id].rank == rank and abs(entry[token_id].logprob - logprob) < TOLERANCE
    assert len(entry) == num_top + (chosen not in top_ids.tolist())
    assert all(isinstance(logprob.decoded_token, str) for logprob in entry.values())


def check_request(output, params: SamplingParams, reference) -> None:
    prompt = output.prompt_token_ids
    if params.prompt_logprobs is None:
        assert output.prompt_logprobs is None
    else:
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        rows = reference(prompt)
        for position in range(1, len(prompt)):
            check_position(output.prompt_logprobs[position], rows[position - 1], prompt[position],
                           params.prompt_logprobs)  # fmt: skip
    assert len(output.outputs) == params.n
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == params.max_tokens
        rows = reference(prompt + completion.token_ids)[len(prompt) - 1 :]
        for index, token_id in enumerate(completion.token_ids):
            check_position(completion.logprobs[index], rows[index], token_id, params.logprobs)
        total = sum(entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids))
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)


def run(llm: LLM) -> list:
    return llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], REQUESTS, use_tqdm=False)


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_num_batched_tokens=7), dict(async_scheduling=True, max_num_batched_tokens=13)],
    ids=["one-step-prefill", "chunked-7", "async-chunked-13"],
)
def test_logprobs_equal_transformers(llama_dir, reference, settings):
    llm = LLM(llama_dir, num_kv_blocks=64, **settings)
    for output, params in zip(run(llm), REQUESTS):
        check_request(output, params, reference)
    assert llm.llm_engine.block_manager.num_free_blocks == 64


def test_prompt_logprobs_are_complete_despite_prefix_cache_hits(llama_dir, reference):
    """The shared prefix is cached by a first run; a request asking for prompt logprobs computes its whole prompt
    anyway (every position's logits are needed), while one that does not ask takes the hit."""
    llm = LLM(llama_dir, num_kv_blocks=64, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS[:3]], plain, use_tqdm=False)
    outputs = run(llm)
    for output, params in zip(outputs, REQUESTS):
        check_request(output, params, reference)
    # Request 2 (70 prompt tokens, no prompt logprobs) takes its four full blocks from the cache; 0 and 1 do not.
    assert [output.num_cached_tokens for output in outputs[:3]] == [0, 0, 64]


def test_no_logprobs_unless_asked(llama_dir):
    output = LLM(llama_dir, num_kv_blocks=16).generate({"prompt_token_ids": PROMPTS[3]}, use_tqdm=False)[0]
    assert output.prompt_logprobs is None
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None
