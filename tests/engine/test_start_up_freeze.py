"""Start-up freezes what it built (gc.freeze) so that full garbage collections during requests stay short; an engine
that ends, by shutdown() or by being dropped, unfreezes it so that its own reference cycles are collected."""

from __future__ import annotations

import gc
import weakref

from pagedllm import LLM


def test_start_up_freezes_and_shutdown_unfreezes(llama_dir):
    llm = LLM(llama_dir, max_model_len=128)
    assert gc.get_freeze_count() > 0
    engine = weakref.ref(llm.llm_engine)
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert engine() is None


def test_a_dropped_engine_is_unfrozen_and_collected(llama_dir):
    llm = LLM(llama_dir, max_model_len=128)
    llm.generate(["hello"], use_tqdm=False)
    engine = weakref.ref(llm.llm_engine)
    del llm
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None
