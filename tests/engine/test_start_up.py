"""Start-up leaves nothing for the first run: nothing for the garbage collector to find, no row count the lm head
has not met."""

from __future__ import annotations

import gc
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor import start_up


def test_start_up_ends_with_a_full_collection(tiny_model_dirs):
    """When LLM() returns, everything start-up built is already old: its last collection of the older generations
    is a full one, made after the block manager's one object per KV block. Objects built after that collection
    count toward the next full one; with an fp8 cache's 137,706 blocks on the H200 they brought it into the first
    timed run (0.30-0.41 s, in 4 of 5 processes)."""
    collected: list[int] = []  # generation of each collection, as it ends

    def record(phase: str, info: dict) -> None:
        if phase == "stop":
            collected.append(info["generation"])

    gc.callbacks.append(record)
    try:
        llm = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=20_000, skip_tokenizer_init=True)
    finally:
        gc.callbacks.remove(record)
    older = [generation for generation in collected if generation >= 1]
    assert older and older[-1] == 2, older[-12:]
    llm.shutdown()


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_start_up_gives_freed_heap_memory_back(tiny_model_dirs, monkeypatch):
    """glibc keeps freed heap memory for later allocations; start-up's last step hands it back. Here: 200 MB freed in
    64 KB pieces (under glibc's mmap threshold, so on the heap) leave the process as large until it runs."""
    calls = []
    monkeypatch.setattr(start_up, "release_freed_heap", lambda: calls.append(1) or True)
    LLM(tiny_model_dirs["qwen3"], num_kv_blocks=64, skip_tokenizer_init=True).shutdown()
    assert calls == [1]  # once, at the end of LLM()
    monkeypatch.undo()
    pieces = [bytearray(64 * 1024) for _ in range(3200)]
    for piece in pieces:
        piece[::4096] = b"x" * len(piece[::4096])  # touch every page
    top = bytearray(64 * 1024)  # alive above them: the heap's top cannot shrink past it on its own
    before_free = resident_mb()
    del pieces, piece
    freed = resident_mb()
    assert start_up.release_freed_heap()
    trimmed = resident_mb()
    assert freed - trimmed > 100, (before_free, freed, trimmed)
    del top


def test_lm_head_warm_up_covers_every_row_count_steps_use(tiny_model_dirs, monkeypatch):
    """On CUDA the lm head's first GEMM at a new row count waited for the device (0.58 s of TinyLlama's first run on
    the H200), so start-up runs it at every row count a step can pass it (start_up.warm_logit_row_counts; on CUDA only,
    called here by hand). A workload of every kind of step, batches larger than max_num_seqs, n > 1 and prompt
    logprobs, passes the lm head no row count that the warm-up did not."""
    llm = LLM(tiny_model_dirs["qwen3"], max_num_seqs=8, max_num_batched_tokens=64, skip_tokenizer_init=True)
    worker = llm.llm_engine.worker
    row_counts: list[int] = []
    compute_logits = worker.model.compute_logits

    def recording(hidden):
        row_counts.append(len(hidden))
        return compute_logits(hidden)

    monkeypatch.setattr(worker.model, "compute_logits", recording)
    start_up.warm_logit_row_counts(worker)
    warmed = set(row_counts)
    row_counts.clear()
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 50 for j in range(5 + 9 * i)]} for i in range(13)]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    llm.generate(prompts[:3], SamplingParams(n=3, max_tokens=4, prompt_logprobs=2, ignore_eos=True))
    assert len(set(row_counts)) > 5 and set(row_counts) <= warmed, sorted(set(row_counts) - warmed)
    llm.shutdown()
