"""Tensor parallelism on CPU (gloo): N ranks give the tokens and logits of one rank, with prefix caching, chunked
prefill, preemption, async scheduling and seeded n > 1 sampling with logprobs at work, for MHA, replicated KV heads
(TP above the KV head count), q/k norms with tied embeddings, biases, a sharded safetensors checkpoint and a GGUF
file; each rank holds ~1/N of the weights. One tensor-parallel engine lives at a time (one torch.distributed group
per process)."""

from __future__ import annotations

import random
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import local_worker, make_config, train_tokenizer
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.executor.executor import Executor
from pagedllm.layers.parallel_state import kv_heads_per_rank

pytestmark = pytest.mark.slow

# Chunks of at most 48 tokens, room for ~2.5 of the longest sequences at once: prefill is chunked and sequences
# are preempted; half the prompts share a 40-token prefix, and every batch runs twice, so the cache is hit.
SETTINGS = dict(enable_prefix_caching=True, max_num_batched_tokens=48, num_kv_blocks=20, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
# Logprobs are differences of logits (up to ~30 on these random models), which N ranks sum in another order: the
# logits' 1e-5 relative agreement allows differences of ~1e-4 in them.
LOGPROB_ATOL = 1e-3
# name -> (checkpoint, tensor_parallel_size, async scheduling)
CASES = {
    "llama_mha_tp2": ("llama_mha", 2, True),  # 4 KV heads split 2 + 2; untied LM head
    "qwen3_sharded_tp2": ("qwen3_sharded", 2, False),  # q/k norms, tied embeddings, many safetensors files
    "llama_gqa_tp4": ("llama_gqa_untied", 4, False),  # 2 KV heads on 4 ranks: each head on 2 ranks
    "qwen2_gguf_tp2": ("qwen2_gguf", 2, True),  # q/k/v biases; Q8_0 GGUF; 261-token vocabulary padded to 262
}


def write_llama_mha(directory: Path) -> None:
    torch.manual_seed(0)
    config = make_config("llama", dict(num_key_value_heads=4, tie_word_embeddings=False))
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    train_tokenizer().save_pretrained(directory)


def write_sharded(source: str, directory: Path) -> None:
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(directory, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, directory / name)
    assert len(list(directory.glob("*.safetensors"))) > 4


def write_gguf(path: Path) -> None:
    loader_tests = str(Path(__file__).parents[1] / "loader")
    if loader_tests not in sys.path:
        sys.path.append(loader_tests)
    from test_gguf_loader import tiny_weights, write_tiny_gguf

    write_tiny_gguf(path, "qwen2", tiny_weights("qwen2", 16, tied=False), 16)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    write_llama_mha(root / "llama_mha")
    write_sharded(tiny_model_dirs["qwen3"], root / "qwen3_sharded")
    write_gguf(root / "qwen2.gguf")
    return {
        "llama_mha": str(root / "llama_mha"),
        "qwen3_sharded": str(root / "qwen3_sharded"),
        "llama_gqa_untied": tiny_model_dirs["llama_gqa_untied"],
        "qwen2_gguf": str(root / "qwen2.gguf"),
    }


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, checkpoints, tmp_path_factory):
    """(one-rank reference, tensor-parallel engine) on the same checkpoint and settings."""
    name, size, overlap = CASES[request.param]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("gguf-cache")))  # the ranks inherit it
        settings = dict(SETTINGS, async_scheduling=overlap)
        if name.endswith("gguf"):  # dequantized: kept blocks multiply in bfloat16, whose sums over shards round
            settings["quantization"] = None  # differently from one rank's (and one rank also keeps the vocabulary)
        reference = LLM(checkpoints[name], **settings)
        with LLM(checkpoints[name], tensor_parallel_size=size, **settings) as parallel:
            yield reference, parallel


def make_prompts(vocab_size: int, count: int = 12, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab_size) for _ in range(40)]
    prompts = []
    for index in range(count):
        tail = [rng.randrange(2, vocab_size) for _ in range(rng.randrange(1, 60))]
        prompts.append({"prompt_token_ids": (prefix if index % 2 else []) + tail})
    return prompts


def vocab_size(llm: LLM) -> int:
    return llm.llm_engine.spec.vocab_size


@contextmanager
def captured_logits(llm: LLM):
    """Every logits tensor the engine computes (on rank 0: the gathered vocabulary) while the block runs."""
    model = local_worker(llm).model
    captured, original = [], model.compute_logits

    def recording(hidden):
        logits = original(hidden)
        captured.append(logits.detach().clone())
        return logits

    model.compute_logits = recording
    try:
        yield captured
    finally:
        del model.compute_logits


def greedy(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_same_tokens_or_near_tie(reference: LLM, prompts, expected, actual, max_gap: float = 1e-4) -> None:
    """Equal, or the first differing token is the other side of a near tie in the one-rank logits."""
    for prompt, want, got in zip(prompts, expected, actual, strict=True):
        if want == got:
            continue
        position = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        context = {"prompt_token_ids": prompt["prompt_token_ids"] + want[:position]}
        with captured_logits(reference) as captured:
            reference.generate([context], ONE_TOKEN, use_tqdm=False)
        logits = captured[-1][0]
        gap = (logits[want[position]] - logits[got[position]]).item()
        assert 0 <= gap < max_gap, f"tokens differ at {position} ({want[position]} vs {got[position]}), gap {gap}"


def test_greedy_tokens_equal_one_rank(engines):
    reference, parallel = engines
    prompts = make_prompts(vocab_size(reference))
    for llm in engines:
        llm.reset_prefix_cache()
    for _ in range(2):  # the second pass is served partly from the prefix cache
        expected, outputs = greedy(reference, prompts), parallel.generate(prompts, GREEDY, use_tqdm=False)
        assert_same_tokens_or_near_tie(reference, prompts, expected, [o.outputs[0].token_ids for o in outputs])
    assert parallel.llm_engine.scheduler.num_preemptions > 0
    assert sum(output.num_cached_tokens for output in outputs) > 0
    block_manager = parallel.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_requests_that_stop_at_different_steps_equal_one_rank(engines):
    """Requests end as users' do, at different steps: their own max_tokens, a stop token met mid-output, or EOS (left
    on). Under async scheduling (two of the cases) the step in flight still holds rows of requests that just ended,
    and rank 0 keeps sending plans while the other ranks run: no request may get another's tokens."""
    reference, parallel = engines
    prompts = make_prompts(vocab_size(reference), count=9, seed=11)
    free_run = greedy(reference, prompts)  # 12 tokens each, EOS ignored
    params = []
    for index, tokens in enumerate(free_run):
        if index % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=2 + index))
        elif index % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[2 + index % 7]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=12))
    expected, actual = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    want, got = ([output.outputs[0].token_ids for output in outputs] for outputs in (expected, actual))
    assert len({len(tokens) for tokens in want}) > 3  # they did stop at different steps
    assert_same_tokens_or_near_tie(reference, prompts, want, got)
    for want_output, got_output in zip(expected, actual, strict=True):
        if want_output.outputs[0].token_ids == got_output.outputs[0].token_ids:
            assert got_output.outputs[0].finish_reason == want_output.outputs[0].finish_reason


def test_seeded_samples_and_logprobs_equal_one_rank(engines):
    """Rank 0 samples from gathered logits: n = 2 (the samples share KV blocks until a copy, on every rank), seeded
    temperature sampling with a penalty, logprobs and prompt logprobs (every rank joins their logits' gathers)."""
    reference, parallel = engines
    params = SamplingParams(n=2, temperature=0.8, seed=7, presence_penalty=0.5, max_tokens=6, logprobs=3,
                            prompt_logprobs=2, ignore_eos=True)  # fmt: skip
    prompts = make_prompts(vocab_size(reference), count=4, seed=5)
    expected, actual = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    for want, got in zip(expected, actual, strict=True):
        for want_sample, got_sample in zip(want.outputs, got.outputs, strict=True):
            assert got_sample.token_ids == want_sample.token_ids
            assert_close_logprobs(want_sample.logprobs, got_sample.logprobs)
        assert_close_logprobs(want.prompt_logprobs[1:], got.prompt_logprobs[1:])  # the first prompt token has none


def test_structured_outputs_equal_one_rank(engines):
    """Rank 0 alone holds the matchers and masks its gathered logits; the other ranks run the same forwards. Seeded
    samples at temperature 1 under a regex equal one rank's, and each satisfies it."""
    pytest.importorskip("llguidance", reason="structured outputs need the structured extra")
    from pagedllm import StructuredOutputsParams

    reference, parallel = engines
    pattern = r"(cat|dog)-[0-9]{1,3}"
    constraint = StructuredOutputsParams(regex=pattern)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=16, structured_outputs=constraint)
              for seed in range(6)]  # fmt: skip
    prompts = make_prompts(vocab_size(reference), count=6, seed=8)
    expected, actual = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    decode = reference.get_tokenizer().decode  # the output's own tokens (random prompts can end inside a character)
    for want, got in zip(expected, actual, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert re.fullmatch(pattern, decode(got.outputs[0].token_ids)), got.outputs[0].text


def assert_close_logprobs(expected: list[dict], actual: list[dict]) -> None:
    for want, got in zip(expected, actual, strict=True):
        assert want.keys() == got.keys()
        assert all(abs(want[token].logprob - got[token].logprob) < LOGPROB_ATOL for token in want)


def test_last_prompt_position_logits_match(engines):
    reference, parallel = engines
    prompts = make_prompts(vocab_size(reference), seed=4)
    captures = []
    for llm in engines:
        llm.reset_prefix_cache()
        with captured_logits(llm) as captured:
            llm.generate(prompts, ONE_TOKEN, use_tqdm=False)
        captures.append(captured)
    assert len(captures[0]) == len(captures[1]) > 0
    for expected, actual in zip(*captures):
        assert actual.shape == expected.shape and actual.shape[-1] == vocab_size(reference)  # padding dropped
        assert (actual - expected).norm() / expected.norm() < 1e-5


def test_the_tensor_parallel_executor_is_an_executor_and_times_rank_0s_steps(engines):
    _, parallel = engines
    engine = parallel.llm_engine
    assert isinstance(engine.worker, Executor) and engine.worker.num_kv_blocks == engine.block_manager.num_blocks
    records = []
    engine.add_step_listener(records.append, device_timings=True)
    try:
        greedy(parallel, make_prompts(vocab_size(parallel))[:2])
    finally:
        engine.remove_step_listener(records.append)
    assert records and all(record.events is not None and record.events.forward_ms() > 0 for record in records)


def test_each_rank_holds_its_share(engines):
    reference, parallel = engines
    size = parallel.llm_engine.config.tensor_parallel_size
    total = reference.llm_engine.worker.weight_bytes()
    per_rank = parallel.llm_engine.worker.weight_bytes_per_rank
    assert len(per_rank) == size and sum(per_rank) >= total
    for count in per_rank:  # replicated norms (and KV heads at TP 4 of 2 heads) are a few percent
        assert abs(count - total / size) < 0.1 * total / size, (count, total / size)
    keys = parallel.llm_engine.worker.worker.kv_cache.keys  # [layers, blocks, block size, heads, head_dim]
    num_kv_heads = reference.llm_engine.spec.num_kv_heads
    assert keys.shape[3] == kv_heads_per_rank(num_kv_heads, size) == max(1, num_kv_heads // size)
