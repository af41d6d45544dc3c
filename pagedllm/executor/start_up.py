"""A Worker's start-up as named phases, run in order by start_worker (the shape of nano-vllm's ModelRunner, whose
constructor makes three named calls: warm up the model, allocate the KV cache, capture the CUDA graphs). Each phase's
docstring says once where it must run and why ("Order:"), and which test guards it ("Guard:").
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.selector import create_backend
from pagedllm.config import ResolvedConfig
from pagedllm.executor.cuda_graphs import DecodeGraphs, PrefillGraphs
from pagedllm.executor.kv_cache import (
    CompanionMemory,
    KVCache,
    allocate_kv_cache,
    bind_kv_cache,
    choose_num_kv_blocks,
    kv_block_bytes,
    measure_warmup_peak,
)
from pagedllm.executor.step_plan import StepPlan, StepSampling
from pagedllm.executor.worker import PROMPT_LOGPROB_CHUNK, Worker
from pagedllm.layers.kernel_choices import building_with_kernels
from pagedllm.layers.parallel_state import SINGLE_RANK, TensorParallelGroup, building_with
from pagedllm.layers.quantization.gguf import describe_formats
from pagedllm.loader.checkpoint import Checkpoint, dequantized_gguf, open_checkpoint
from pagedllm.loader.weights import load_weights
from pagedllm.logger import logger
from pagedllm.models.registry import build_model
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler

# Start-up runs its largest steps with these settings, so the KV cache is sized after the sampler's largest
# footprint: a full sort (top-p alone) and logprobs for every row.
WARMUP_SAMPLING = SamplingParams(top_p=0.9, logprobs=20)
WARMUP_PROMPT_LOGPROBS = 20


def start_worker(
    resolved: ResolvedConfig,
    checkpoint: Checkpoint | None = None,
    tp: TensorParallelGroup = SINGLE_RANK,
    device: torch.device | None = None,
    companion: CompanionMemory | None = None,
) -> Worker:
    """A Worker ready for its first plan. resolved: the engine's settings and kernel choices, resolved once on rank
    0; every rank runs them. checkpoint: already opened by the caller (rank 0 reads config and tokenizer from it),
    else opened here. tp: this worker's rank and group; the model holds that rank's shard. device: this rank's
    (resolved.device if None). companion: what a draft model loaded after it will take, left free by its cache."""
    free_dropped_engines()
    if checkpoint is None:
        checkpoint = open_checkpoint(
            resolved.config.model, load_tokenizer=False, write_cache=False, gguf_file=resolved.config.gguf_file
        )
        checkpoint = weights_to_load(checkpoint, resolved, write_cache=False)
    worker = Worker(resolved, DecoderSpec.from_hf_config(checkpoint.hf_config), tp, device or resolved.device)
    worker.model, worker.backend, worker.sampler = load_model(worker, checkpoint)
    warmup_peak = warm_up(worker)
    worker.num_kv_blocks, worker.kv_cache = size_kv_cache(worker, warmup_peak, companion)
    if captures_graphs(worker):
        worker.prefill_graphs, worker.graphs = capture_graphs(worker)
    prime_first_request(worker)
    return worker


def weights_to_load(checkpoint: Checkpoint, resolved: ResolvedConfig, write_cache: bool) -> Checkpoint:
    """A GGUF file's weights are read as blocks where the engine keeps them quantized, else from their float32
    conversion cached on disk (written now with write_cache: the engine's rank 0)."""
    if checkpoint.weights_format == "gguf" and resolved.kernels.quantization != "gguf":
        return dequantized_gguf(checkpoint, write_cache)
    return checkpoint


def free_dropped_engines() -> None:
    """An engine dropped without shutdown() sits in reference cycles, holding its weights and KV cache until a full
    collection: one now.
    Order: first, because this engine loads its weights and sizes its cache from the memory left.
    Guard: tests/engine/test_invariants.py, test_an_engine_dropped_without_shutdown_is_freed_by_the_next_start_up."""
    gc.collect()


def load_model(worker: Worker, checkpoint: Checkpoint) -> tuple[nn.Module, AttentionBackend, Sampler | None]:
    """This rank's shard of the model, built with the kernel choices and the tensor-parallel group, and its weights;
    the attention backend; on rank 0 (the one that samples) the sampler, one state per sequence the scheduler may have
    admitted at once (max_num_seqs), whose penalty counts are allocated at once on CUDA.
    Order: before size_kv_cache, because the cache takes the memory left: a penalised request never runs out later.
    Guard: none (it would take a full GPU)."""
    config, device, kernels = worker.config, worker.device, worker.kernels
    with building_with(worker.tp), building_with_kernels(kernels):
        model = build_model(worker.spec, worker.max_model_len, worker.dtype, device)
    load_weights(model, checkpoint.named_tensors(worker.dtype), checkpoint.source)
    if kernels.quantization == "gguf":
        start_up_log(worker)("GGUF weights: %s", describe_formats(model))
    backend = create_backend(kernels.attention, kernels.torch_prompt_sdpa)
    sampler = None
    if worker.tp.rank == 0:
        sampler = Sampler(config.max_num_seqs, worker.spec.vocab_size, device, config.seed, kernels)
    if device.type == "cuda" and sampler is not None:
        sampler.penalties.allocate()
    return model, backend, sampler


def warm_up(worker: Worker) -> int:
    """On CUDA, start_up_steps() once on a throwaway cache, however the cache is sized: it compiles and loads what
    they use, so that no user request pays for it. Returns their peak memory beyond what stays allocated (0 on CPU,
    whose cache is sized from free host memory).
    Order: after load_model, because the steps run the model and the sampler; before size_kv_cache, because the
    cache leaves room for this peak.
    Guard: tests/gpu/test_gpu_first_run.py, test_requests_after_start_up_compile_nothing (the sizing: none, it would
    take a full GPU)."""
    if worker.device.type != "cuda":
        return 0
    return measure_warmup_peak(worker.device, lambda: run_on_throwaway_cache(worker))


def size_kv_cache(worker: Worker, warmup_peak: int, companion: CompanionMemory | None = None) -> tuple[int, KVCache]:
    """How many blocks (the rank with the least room sets the number: every rank holds the same block ids), the
    cache allocated and bound to the attention layers, and the start-up line with the kernel choices. The cache
    leaves room for the warm-up's peak twice when graphs are captured: the prefill graphs keep a forward's
    activations in their own memory pool, beside what the eager parts of a step (logits, sampler) allocate. A
    companion (a draft model) gets its share: its blocks beside each of ours, its weights, and that room again.
    Order: after warm_up, because it needs the peak.
    Guard: tests/executor/test_kv_cache.py (the count), tests/executor/test_tensor_parallel.py (ranks agree)."""
    config = worker.config
    block_bytes = kv_block_bytes(worker.spec, config.block_size, worker.dtype, worker.tp.size, config.kv_cache_dtype)
    reserved = warmup_peak * (2 if captures_graphs(worker) else 1)
    sized_bytes = block_bytes
    if companion is not None:
        reserved, sized_bytes = 2 * reserved + companion.fixed_bytes, block_bytes + companion.block_bytes
    num_kv_blocks = choose_num_kv_blocks(config, sized_bytes, worker.max_model_len, worker.device, reserved)
    num_kv_blocks = worker.tp.min_over_ranks(num_kv_blocks)
    kv_cache = bind_new_kv_cache(worker, num_kv_blocks)
    start_up_log(worker)(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB%s) on %s; kernels: %s; %d CPU thread%s (%s)",
        num_kv_blocks, config.block_size, num_kv_blocks * config.block_size, num_kv_blocks * block_bytes / 2**30,
        ", fp8" if config.kv_cache_dtype == "fp8" else "", worker.device, worker.kernels.describe(),
        torch.get_num_threads(), "" if torch.get_num_threads() == 1 else "s", worker.resolved.threads_source,
    )  # fmt: skip
    return num_kv_blocks, kv_cache


def captures_graphs(worker: Worker) -> bool:
    """CUDA graphs are captured where steps are padded to their shapes (the Triton backend on CUDA), unless
    enforce_eager."""
    return worker.pads_steps and not worker.config.enforce_eager


@torch.inference_mode()
def capture_graphs(worker: Worker) -> tuple[PrefillGraphs, DecodeGraphs]:
    """The prefill graphs, then the decode graphs into the same memory pool (the largest first: the others reuse its
    memory); logs how long it took and how much memory the pool holds. In inference mode, as steps run:
    torch.compile guards on the grad mode, and outside it the capture compiled each fused function again.
    Order: after size_kv_cache, because a graph replays on the tensors it was captured with, the real cache's.
    Guard: tests/gpu/test_gpu_engine.py, test_cuda_graphs_change_nothing; tests/gpu/test_gpu_first_run.py,
    test_graph_capture_compiles_nothing_the_eager_warm_up_did_not."""
    config, device = worker.config, worker.device
    started, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    prefill = PrefillGraphs(
        worker.model, worker.buffers, worker.prefill_token_counts, config.max_num_seqs, worker.max_model_len
    )
    pool = prefill.capture()
    decode = DecodeGraphs(worker.model, worker.buffers, config.max_num_seqs, worker.max_model_len)
    decode.capture(pool)
    start_up_log(worker)(
        "CUDA graphs: %d prompt-step sizes (%d-%d tokens) and %d decode batch sizes in %.1f s, %.2f GiB",
        len(prefill.sizes), prefill.sizes[0], prefill.sizes[-1], len(decode.sizes), time.perf_counter() - started,
        (torch.cuda.memory_reserved(device) - reserved) / 2**30,
    )  # fmt: skip
    return prefill, decode


def prime_first_request(worker: Worker) -> None:
    """On CUDA, what a first request would otherwise pay for: the sampler's compiled paths (its warm-up takes state
    indices 0 and 1, so before any request), torch's caching allocator refilled (sizing the cache emptied it), the lm
    head's row counts, the pinned pool.
    Order: last, after capture_graphs, because the refill runs the largest steps on the real cache as requests will,
    graphs and all, so that the allocator keeps what requests' steps take beside the graphs' pool.
    Guard: tests/gpu/test_gpu_first_run.py, test_a_fresh_engines_first_run_is_as_fast_as_its_later_ones (no
    compilation, cudaMalloc or cudaHostAlloc in a first run); tests/gpu/test_gpu_sampling.py,
    test_start_up_leaves_no_sampler_path_to_compile; tests/engine/test_start_up.py (the lm head's row counts);
    tests/engine/test_invariants.py, test_start_up_steps_on_the_real_cache_change_nothing."""
    if worker.device.type != "cuda":
        return
    if worker.sampler is not None:
        worker.sampler.warmup()
    refill_allocator(worker)
    warm_logit_row_counts(worker)
    fill_pinned_pool()


def start_up_log(worker: Worker) -> Callable[..., None]:
    """Rank 0 logs start-up at INFO, the other ranks at DEBUG."""
    return logger.info if worker.tp.rank == 0 else logger.debug


def bind_new_kv_cache(worker: Worker, num_blocks: int) -> KVCache:
    config = worker.config
    kv_cache = allocate_kv_cache(
        worker.spec, num_blocks, worker.block_size, worker.dtype, worker.device, worker.tp.size, config.kv_cache_dtype
    )
    bind_kv_cache(worker.model, kv_cache, worker.backend)
    return kv_cache


def start_up_steps(worker: Worker) -> tuple[list[StepPlan], int]:
    """The largest prefill step, the largest decode step and a one-sequence decode step as synthetic plans, and how
    many blocks (from block 0) they write. The small step compiles what only few rows take (the skinny GEMM) when no
    CUDA graph capture does."""
    config = worker.config
    seq_len = min(worker.max_model_len, config.max_num_batched_tokens)
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // seq_len))
    blocks_per_seq = -(-seq_len // worker.block_size)
    num_prefill_blocks = num_seqs * blocks_per_seq
    prefill_tables = np.arange(num_prefill_blocks, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
    decode_tables = num_prefill_blocks + np.arange(config.max_num_seqs, dtype=np.int32)[:, None]
    plans = [synthetic_plan(worker, prefill_tables, seq_len), synthetic_plan(worker, decode_tables, 1)]
    plans.append(synthetic_plan(worker, decode_tables[:1], 1))
    return plans, num_prefill_blocks + config.max_num_seqs


@torch.inference_mode()
def run_on_throwaway_cache(worker: Worker) -> None:
    """Run start_up_steps() once, on a throwaway cache."""
    plans, num_blocks = start_up_steps(worker)
    bind_new_kv_cache(worker, num_blocks)
    for plan in plans:
        worker.execute(plan)
    bind_new_kv_cache(worker, 0)  # drop the throwaway cache before free memory is measured


@torch.inference_mode()
def refill_allocator(worker: Worker) -> None:
    """Sizing the cache emptied torch's caching allocator after the warm-up. The largest steps once more, over the
    real cache's first blocks (no request holds them yet, and a request writes a block before reading it), leave the
    activations' and the sampler's memory in the allocator again: the benchmark's first run then called cudaMalloc 0
    times (2-4 before). A cache too small for these steps is left alone."""
    plans, num_blocks = start_up_steps(worker)
    if num_blocks <= worker.num_kv_blocks:
        for plan in plans:
            worker.execute(plan)
        if worker.device.type == "cuda":
            torch.cuda.synchronize(worker.device)


@torch.inference_mode()
def warm_logit_row_counts(worker: Worker) -> None:
    """The lm head's GEMM runs eagerly, after a step's graph, on the rows the step samples (1..max_num_seqs, and
    with speculative decoding up to k + 1 per sequence) or on a chunk of prompt-logprob rows (up to
    PROMPT_LOGPROB_CHUNK). The first GEMM at each new row count waits for the device, which a user's first run would
    otherwise pay (benchmarks/NOTES.md, "Moved from docstrings"). Every row count once, here (a few hundred small
    GEMMs, a few thousand with speculation)."""
    num_rows = max(worker.resolved.max_sampled_rows, PROMPT_LOGPROB_CHUNK)
    hidden = torch.zeros(num_rows, worker.spec.hidden_size, dtype=worker.dtype, device=worker.device)
    for rows in range(1, num_rows + 1):
        worker.model.compute_logits(hidden[:rows])
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def synthetic_plan(worker: Worker, block_tables: np.ndarray, seq_len: int) -> StepPlan:
    """Every sequence computes seq_len tokens of id 0 from scratch and samples with WARMUP_SAMPLING (on rank 0, the
    one that samples); a prefill also takes a chunk of prompt logprobs."""
    num_seqs = len(block_tables)
    positions = np.tile(np.arange(seq_len, dtype=np.int64), num_seqs)
    rows = np.repeat(np.arange(num_seqs), seq_len)
    slots = block_tables[rows, positions // worker.block_size].astype(np.int64) * worker.block_size
    query_start_loc = np.arange(num_seqs + 1, dtype=np.int32) * seq_len
    num_prompt_logprob_rows = 0 if seq_len == 1 else min(PROMPT_LOGPROB_CHUNK, len(positions))
    return StepPlan(
        step_id=-1,
        input_ids=np.zeros(num_seqs * seq_len, dtype=np.int64),
        positions=positions,
        slot_mapping=slots + positions % worker.block_size,
        query_start_loc=query_start_loc,
        seq_lens=np.full(num_seqs, seq_len, dtype=np.int32),
        block_tables=block_tables,
        sample_rows=query_start_loc[1:].astype(np.int64) - 1,
        max_query_len=seq_len,
        max_seq_len=seq_len,
        decode_only=seq_len == 1,
        sampling=StepSampling(
            batch=build_sampling_batch([WARMUP_SAMPLING] * num_seqs),
            row_state_indices=np.zeros(num_seqs, dtype=np.int64),  # no state: these settings need none
            prompt_logprob_token_ids=np.zeros(num_prompt_logprob_rows, dtype=np.int64),
            num_prompt_logprobs=WARMUP_PROMPT_LOGPROBS,
        )
        if worker.sampler is not None
        else None,
        prompt_logprob_rows=np.arange(num_prompt_logprob_rows, dtype=np.int64),
    )


def fill_pinned_pool(max_bytes: int = 1 << 16, copies: int = 8) -> None:
    """Steps stage small arrays through pinned host memory (sampling settings up, sampled tokens down), taken from
    torch's pinned pool, which rounds sizes up to powers of two and keeps freed blocks. Blocks of every size up to
    max_bytes, `copies` of each (more than the steps in flight hold at once), keep cudaHostAlloc out of requests' steps:
    the benchmark's first run called it 21 times, later runs none."""
    blocks = [
        torch.empty(1 << bits, dtype=torch.uint8, pin_memory=True)
        for bits in range(max_bytes.bit_length())
        for _ in range(copies)
    ]  # all held at once, so the pool makes `copies` blocks of each size
    del blocks  # back to the pool, which keeps them pinned


def collect_start_up_garbage() -> None:
    """The last step of start-up, after everything it builds (LLMEngine's, or a serving rank's). A full collection
    scans every object alive, and start-up leaves many (a full collection in a first run paused it for tenths of a
    second: benchmarks/NOTES.md, "Moved from docstrings"). Collecting now starts afresh the count that triggers the
    next full collection: it waits until a quarter as many objects again have outlived the younger collections
    (CPython 3.12), more than a run keeps. Objects built after this call count toward it, so it runs after the block
    manager's one object per KV block is built.
    (Freezing the survivors, gc.freeze(), would also keep them out of later full collections, but an engine dropped
    without shutdown() sits in reference cycles and would then never be freed, its KV cache held.)
    Guard: tests/engine/test_start_up.py, test_start_up_ends_with_a_full_collection.
    Then, with glibc, the memory that loading freed goes back to the system: glibc keeps freed heap memory for later
    allocations, and the GGUF blocks' unpacking left ~80 MB of it (the default model: 546 -> 464 MB resident).
    Guard: test_start_up_gives_freed_heap_memory_back."""
    gc.collect()
    release_freed_heap()


def release_freed_heap() -> bool:
    """malloc_trim(0) where the C library has it (glibc); whether it ran."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # another C library: nothing to do
        return False
    trim(0)
    return True
