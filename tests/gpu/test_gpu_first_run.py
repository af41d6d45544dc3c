"""Start-up does every one-time job (run with `pytest -m gpu tests/gpu`): after `LLM()`, requests of new batch sizes
and prompt lengths build no Triton kernel and no torch.compile graph, a fresh engine's first run grows neither
allocator and meets no full garbage collection, and it is as fast as its later runs."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import triton

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]

SMALL = dict(num_kv_blocks=4096, max_num_seqs=64)  # several engines share the GPU within one test process


class CompilationCounter:
    """Counts Triton JIT compilations (Triton's post-compile hook) and new torch.compile graphs from its start."""

    def __enter__(self) -> CompilationCounter:
        from torch._dynamo.utils import counters

        self.triton = []
        self.previous_hook = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = lambda *, repr, **_: self.triton.append(repr)  # noqa: A006
        self.graphs_before = counters["stats"]["unique_graphs"]
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.utils import counters

        triton.knobs.runtime.jit_post_compile_hook = self.previous_hook
        self.graphs = counters["stats"]["unique_graphs"] - self.graphs_before


class FullCollections:
    """The garbage collector's full (generation 2) collections while active, and how long each paused the process."""

    def __enter__(self) -> FullCollections:
        self.pauses: list[float] = []
        gc.callbacks.append(self.callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self.started = time.perf_counter()
            else:
                self.pauses.append(time.perf_counter() - self.started)


def allocator_calls() -> tuple[int, int]:
    """cudaMalloc calls of torch's caching allocator and cudaHostAlloc calls of its pinned-memory allocator so far."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0), torch.cuda.host_memory_stats()["num_host_alloc"]


def workload(seed: int, num_prompts: int, lengths: tuple[int, int]) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(2, 300) for _ in range(rng.randint(*lengths))]} for _ in range(num_prompts)
    ]


def run(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def test_requests_after_start_up_compile_nothing(tiny_model_dirs):
    """Batches of 1, 8, 16, 13 and 48 prompts (Triton specialises integers equal to 1 and divisible by 16), short and
    long prompts, and chunked prefill: not one compilation after LLM() returned."""
    llm = LLM(tiny_model_dirs["qwen3"], max_num_batched_tokens=512, **SMALL)
    with CompilationCounter() as counted:
        for seed, (num_prompts, lengths) in enumerate([(1, (5, 5)), (8, (20, 40)), (16, (3, 200)), (13, (300, 900)),
                                                       (48, (1, 64))]):  # fmt: skip
            run(llm, workload(seed, num_prompts, lengths), max_tokens=8)
    assert counted.triton == [] and counted.graphs == 0, (counted.triton, counted.graphs)


def test_graph_capture_compiles_nothing_the_eager_warm_up_did_not(tiny_model_dirs):
    """The graphs are captured in inference mode, as steps run: torch.compile guards on the grad mode, and a capture
    outside inference mode compiled every fused function a second time. Compiled code starts empty here, so the
    eager engine compiles what its warm-up needs and the graph engine may add nothing."""
    torch._dynamo.reset()
    directory = tiny_model_dirs["qwen3"]
    LLM(directory, enforce_eager=True, **SMALL).shutdown()
    with CompilationCounter() as counted:
        LLM(directory, **SMALL).shutdown()
    assert counted.graphs == 0, counted.graphs


@dataclass
class FirstRun:
    ratio: float  # first run / later runs, each against the reference engine's runs beside it
    timings: str
    one_time_work: dict[str, int]  # what start-up should have done instead: counts in the first run


def fresh_engine_runs(directory: str, prompts: list[dict], reference: LLM) -> FirstRun:
    """A fresh engine's first run and its next three, each timed against runs of a warm reference engine just
    before and after it, in the same process: this workload is host-bound (a tiny model), and on the GPU machine
    the host's speed drifts by more than 5% over seconds (benchmarks/NOTES.md), so each time is read against the
    same work timed on the same host at the same moment."""
    llm = LLM(directory, **SMALL)
    reference_before = run(reference, prompts, max_tokens=96)
    calls_before = allocator_calls()
    with FullCollections() as collections, CompilationCounter() as compiled:
        first = run(llm, prompts, max_tokens=96)
    mallocs, host_allocs = (after - before for after, before in zip(allocator_calls(), calls_before))
    reference_times = [reference_before, run(reference, prompts, max_tokens=96)]
    first_relative = first / statistics.mean(reference_times)
    later_relative = []
    for _ in range(3):
        later = run(llm, prompts, max_tokens=96)
        reference_times.append(run(reference, prompts, max_tokens=96))
        later_relative.append(later / statistics.mean(reference_times[-2:]))
    llm.shutdown()
    work = dict(triton_compilations=len(compiled.triton), torch_compile_graphs=compiled.graphs, cuda_malloc=mallocs,
                cuda_host_alloc=host_allocs, full_garbage_collections=len(collections.pauses))  # fmt: skip
    timings = f"first {first:.3f} s, {first_relative:.3f} of the reference's; later " + ", ".join(
        f"{ratio:.3f}" for ratio in later_relative
    )
    return FirstRun(first_relative / statistics.median(later_relative), timings, work)


def test_a_fresh_engines_first_run_is_as_fast_as_its_later_ones(tiny_model_dirs):
    """Engines built one after another in one process (the first pays Triton's on-disk cache misses and the process's
    first pass through the engine's Python, and then serves as the warm reference). Each later engine's first run
    compiles nothing, grows neither the caching allocator nor the pinned pool, meets no full garbage collection
    (start-up did all of that), and the median over engines of first run / later runs, each against the reference
    engine timed beside it, is within 5%. (Timed alone, single runs of one engine spread by more than 5%: 0.37-0.55
    s; in one call three engines' first / later came to 1.14, 0.87 and 1.20. Five engines, not three: with three,
    one run in three crossed 1.05 by noise, while cProfile showed run 0's host work within 1 ms of run 1's.)"""
    prompts = workload(7, 128, (16, 512))
    directory = tiny_model_dirs["llama_gqa_untied"]
    with LLM(directory, **SMALL) as reference:
        run(reference, prompts, max_tokens=96)
        runs = [fresh_engine_runs(directory, prompts, reference) for _ in range(5)]
    assert all(not any(r.one_time_work.values()) for r in runs), [r.one_time_work for r in runs]
    print("\n".join(r.timings for r in runs))
    assert statistics.median(r.ratio for r in runs) <= 1.05, [r.timings for r in runs]
