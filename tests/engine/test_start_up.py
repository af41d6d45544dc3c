"""Start-up leaves nothing for the garbage collector to find in the first run."""

from __future__ import annotations

import gc

from pagedllm import LLM


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
