"""Worker: the device side of the engine. It owns the model and its weights, the KV cache, the attention backend,
the CUDA graphs, the step buffers and the sampler with its per-request state, and turns a StepPlan into a StepOutput.

Under tensor parallelism every rank has a Worker holding its shard; all of them execute the same plans in the same
order (their collectives pair up that way), and only rank 0 has a sampler.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention.selector import create_backend
from pagedllm.config import EngineConfig
from pagedllm.executor.cuda_graphs import (
    DecodeGraphs,
    PrefillGraphs,
    graph_batch_sizes,
    graph_token_counts,
    padded_batch_size,
)
from pagedllm.executor.kv_cache import (
    KVCache,
    allocate_kv_cache,
    bind_kv_cache,
    choose_num_kv_blocks,
    kv_block_bytes,
    measure_warmup_peak,
)
from pagedllm.executor.step_inputs import StepBuffers, StepInputs, pad_decode_plan, pad_prefill_plan, wrap_plan
from pagedllm.executor.step_output import StepEvents, StepOutput
from pagedllm.executor.step_plan import StepPlan, StepSampling
from pagedllm.kernel_selection import resolve_kernel_choices
from pagedllm.layers.kernel_choices import building_with_kernels
from pagedllm.layers.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.layers.parallel_state import SINGLE_RANK, TensorParallelGroup, building_with
from pagedllm.layers.sampler import Sampler, TokenMask
from pagedllm.layers.sampling_batch import array_to_device, build_sampling_batch
from pagedllm.loader.checkpoint import Checkpoint, open_checkpoint
from pagedllm.loader.weights import load_weights
from pagedllm.logger import logger
from pagedllm.models.registry import build_model
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backend import bitmask_words

# Prompt logprobs: logits of at most this many prompt rows exist at once (rows x vocab x ~12 bytes at the peak).
PROMPT_LOGPROB_CHUNK = 256
# Start-up runs its largest steps with these settings, so the KV cache is sized after the sampler's largest
# footprint: a full sort (top-p alone) and logprobs for every row.
WARMUP_SAMPLING = SamplingParams(top_p=0.9, logprobs=20)
WARMUP_PROMPT_LOGPROBS = 20


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        checkpoint: Checkpoint | None = None,
        tp: TensorParallelGroup = SINGLE_RANK,
    ):
        """checkpoint: already opened by the caller (rank 0 reads config and tokenizer from it), else opened here.
        tp: this worker's rank and group; the model holds that rank's shard."""
        # An engine dropped without shutdown() sits in reference cycles, holding its weights and KV cache until a full
        # collection: free them before this one loads weights and sizes its cache from the memory left.
        gc.collect()
        checkpoint = checkpoint or open_checkpoint(config.model, load_tokenizer=False, convert_gguf=False)
        self.config, self.device, self.dtype, self.tp = config, device, dtype, tp
        self.spec = DecoderSpec.from_hf_config(checkpoint.hf_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.buffers: StepBuffers | None = None
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        if device.type == "cuda":
            table_width = -(-max_model_len // config.block_size)  # any sequence's block table fits
            # A grammar's bitmask row covers the model's vocabulary (structured outputs).
            widths = {"bitmask_words": bitmask_words(self.spec.vocab_size)}
            self.buffers = StepBuffers(max_tokens, config.max_num_seqs, table_width, device, widths=widths)
        self.decode_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.prefill_token_counts = graph_token_counts(max_tokens)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.kernels = resolve_kernel_choices(
            config.attention_backend, device, self.spec.head_dim, config.kv_cache_dtype
        )  # which kernels the model, the attention backend and the sampler run
        with building_with(tp), building_with_kernels(self.kernels):
            self.model = build_model(self.spec, max_model_len, dtype, device)
        load_weights(self.model, checkpoint.named_tensors(dtype), checkpoint.source)
        self.backend = create_backend(self.kernels.attention)
        # CUDA with the Triton backend: every step runs at a graph's shapes, with graphs or without (enforce_eager),
        # so that graphs on and off give bit-identical results (the same matmul shapes).
        self.pads_steps = self.buffers is not None and self.kernels.attention == "triton"
        # One slot per sequence the scheduler may have admitted at once (running or preempted): max_num_seqs.
        # Only rank 0 samples.
        self.sampler = None
        if tp.rank == 0:
            self.sampler = Sampler(config.max_num_seqs, self.spec.vocab_size, device, config.seed, self.kernels)
        if device.type == "cuda" and self.sampler is not None:
            self.sampler.penalties.allocate()  # before the KV cache takes what is left
        self.record_events = False  # set by the engine when someone wants device timings
        block_bytes = kv_block_bytes(self.spec, config.block_size, dtype, tp.size, config.kv_cache_dtype)
        # On CUDA the warm-up always runs, whatever sizes the cache: it compiles and loads what the start-up steps
        # use (largest prefill, largest decode, one-sequence decode), so that no user request pays for it.
        warmup_peak = measure_warmup_peak(device, self.warmup) if device.type == "cuda" else 0
        # The prefill graphs keep a forward's activations in their own memory pool, beside what the eager parts of
        # a step (logits, sampler) allocate: the cache leaves room for the warm-up's peak twice.
        captures_graphs = self.pads_steps and not config.enforce_eager
        reserved = warmup_peak * (2 if captures_graphs else 1)
        num_kv_blocks = choose_num_kv_blocks(config, block_bytes, max_model_len, device, reserved)
        # Every rank holds the same block ids, so the rank with the least room sets the number.
        self.num_kv_blocks = tp.min_over_ranks(num_kv_blocks)
        self.kv_cache = self.bind_kv_cache(self.num_kv_blocks)
        log = logger.info if tp.rank == 0 else logger.debug
        log(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB%s) on %s; kernels: %s",
            self.num_kv_blocks, config.block_size, self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * block_bytes / 2**30, ", fp8" if config.kv_cache_dtype == "fp8" else "", device,
            self.kernels.describe(),
        )  # fmt: skip
        if captures_graphs:
            self.capture_graphs(log)
        if device.type == "cuda" and self.sampler is not None:
            self.sampler.warmup()  # compiles every sampler path now rather than in some request's step
        if device.type == "cuda":  # what a first request would otherwise pay for, paid here
            self.refill_allocator()
            self.warm_logit_row_counts()
            fill_pinned_pool()

    @torch.inference_mode()
    def capture_graphs(self, log: Callable[..., None]) -> None:
        """The prefill graphs, then the decode graphs into the same memory pool (the largest first: the others
        reuse its memory); logs how long it took and how much memory the pool holds. In inference mode, as steps
        run: torch.compile guards on the grad mode, and outside it the capture compiled each fused function again."""
        config, started, reserved = self.config, time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self.prefill_graphs = PrefillGraphs(
            self.model, self.buffers, self.prefill_token_counts, config.max_num_seqs, self.max_model_len
        )
        pool = self.prefill_graphs.capture()
        self.graphs = DecodeGraphs(self.model, self.buffers, config.max_num_seqs, self.max_model_len)
        self.graphs.capture(pool)
        log(
            "CUDA graphs: %d prompt-step sizes (%d-%d tokens) and %d decode batch sizes in %.1f s, %.2f GiB",
            len(self.prefill_graphs.sizes), self.prefill_graphs.sizes[0], self.prefill_graphs.sizes[-1],
            len(self.graphs.sizes), time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**30,
        )  # fmt: skip

    def bind_kv_cache(self, num_blocks: int) -> KVCache:
        kv_cache = allocate_kv_cache(
            self.spec, num_blocks, self.block_size, self.dtype, self.device, self.tp.size, self.config.kv_cache_dtype
        )
        bind_kv_cache(self.model, kv_cache, self.backend)
        return kv_cache

    def start_up_steps(self) -> tuple[list[StepPlan], int]:
        """The largest prefill step, the largest decode step and a one-sequence decode step as synthetic plans, and how
        many blocks (from block 0) they write. The small step compiles what only few rows take (the skinny GEMM)
        when no CUDA graph capture does."""
        seq_len = min(self.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // seq_len))
        blocks_per_seq = -(-seq_len // self.block_size)
        num_prefill_blocks = num_seqs * blocks_per_seq
        prefill_tables = np.arange(num_prefill_blocks, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        decode_tables = num_prefill_blocks + np.arange(self.config.max_num_seqs, dtype=np.int32)[:, None]
        plans = [self.synthetic_plan(prefill_tables, seq_len), self.synthetic_plan(decode_tables, 1)]
        plans.append(self.synthetic_plan(decode_tables[:1], 1))
        return plans, num_prefill_blocks + self.config.max_num_seqs

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run start_up_steps() once, on a throwaway cache."""
        plans, num_blocks = self.start_up_steps()
        self.bind_kv_cache(num_blocks)
        for plan in plans:
            self.execute(plan)
        self.bind_kv_cache(0)  # drop the throwaway cache before free memory is measured

    @torch.inference_mode()
    def refill_allocator(self) -> None:
        """Sizing the cache emptied torch's caching allocator after the warm-up. The largest steps once more, over the
        real cache's first blocks (no request holds them yet, and a request writes a block before reading it), leave
        the activations' and the sampler's memory in the allocator again: the benchmark's first run then called
        cudaMalloc 0 times (2-4 before). A cache too small for these steps is left alone."""
        plans, num_blocks = self.start_up_steps()
        if num_blocks <= self.num_kv_blocks:
            for plan in plans:
                self.execute(plan)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_logit_row_counts(self) -> None:
        """The lm head's GEMM runs eagerly, after a step's graph, on the rows the step samples (1..max_num_seqs) or
        on a chunk of prompt-logprob rows (up to PROMPT_LOGPROB_CHUNK). The first GEMM at each new row count waited
        for the device: TinyLlama's first benchmark run spent 0.58 s more inside this GEMM than its second run
        (cProfile, H200), its launches serialised behind the device, so its first run was 94% of the later ones.
        Every row count once, here (a few hundred small GEMMs)."""
        num_rows = max(self.config.max_num_seqs, PROMPT_LOGPROB_CHUNK)
        hidden = torch.zeros(num_rows, self.spec.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, num_rows + 1):
            self.model.compute_logits(hidden[:rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def synthetic_plan(self, block_tables: np.ndarray, seq_len: int) -> StepPlan:
        """Every sequence computes seq_len tokens of id 0 from scratch and samples with WARMUP_SAMPLING (on rank 0,
        the one that samples); a prefill also takes a chunk of prompt logprobs."""
        num_seqs = len(block_tables)
        positions = np.tile(np.arange(seq_len, dtype=np.int64), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = block_tables[rows, positions // self.block_size].astype(np.int64) * self.block_size
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32) * seq_len
        num_prompt_logprob_rows = 0 if seq_len == 1 else min(PROMPT_LOGPROB_CHUNK, len(positions))
        return StepPlan(
            step_id=-1,
            input_ids=np.zeros(num_seqs * seq_len, dtype=np.int64),
            positions=positions,
            slot_mapping=slots + positions % self.block_size,
            query_start_loc=query_start_loc,
            seq_lens=np.full(num_seqs, seq_len, dtype=np.int32),
            block_tables=block_tables,
            sample_rows=query_start_loc[1:].astype(np.int64) - 1,
            max_query_len=seq_len,
            max_seq_len=seq_len,
            decode_only=seq_len == 1,
            sampling=StepSampling(
                batch=build_sampling_batch([WARMUP_SAMPLING] * num_seqs),
                row_slots=np.zeros(num_seqs, dtype=np.int64),  # no state: these settings need none
                prompt_logprob_token_ids=np.zeros(num_prompt_logprob_rows, dtype=np.int64),
                num_prompt_logprobs=WARMUP_PROMPT_LOGPROBS,
            )
            if self.sampler is not None
            else None,
            prompt_logprob_rows=np.arange(num_prompt_logprob_rows, dtype=np.int64),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous: StepOutput | None = None) -> StepOutput:
        """Queue one step on the device without waiting for it. Input tokens still unknown on the host
        (sampled by the step in flight) are taken on the device from `previous`."""
        if self.model is None:
            raise RuntimeError("this engine was shut down; create a new LLM")
        if plan.sampling is not None:
            self.update_sampler(plan.sampling)
        if len(plan.block_copies):
            self.kv_cache.copy_blocks(upload_array(plan.block_copies, self.device))
        plan, graphs, padded_size = self.pad_to_graph(plan)
        events = StepEvents.create(self.device) if self.record_events else None
        if events is not None:
            events.start.record()
        inputs = self.buffers.upload(plan) if self.buffers is not None else wrap_plan(plan)
        if len(plan.placeholder_rows):
            self.fill_placeholders(inputs, previous)
        if graphs is not None:
            hidden = graphs.replay(padded_size)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if events is not None:
            events.forward_done.record()
        sampled = None
        if plan.num_sampled:
            rows = plan.sample_rows
            # Most decode steps sample row r for row r: their rows are taken as a view, without a gather.
            in_order = np.array_equal(rows, np.arange(len(rows)))
            sample_hidden = hidden[: len(rows)] if in_order else hidden[inputs.sample_rows]
            logits = self.model.compute_logits(sample_hidden)  # None on ranks other than 0
            if logits is not None:
                mask = TokenMask(inputs.token_bitmask, inputs.bitmask_rows) if len(plan.bitmask_rows) else None
                sampled = self.sampler(logits, plan.sampling.batch, mask)
        prompt_logprobs = self.prompt_logprobs(hidden, plan) if len(plan.prompt_logprob_rows) else None
        if events is not None:
            events.end.record()
        return StepOutput(plan.step_id, sampled, prompt_logprobs, events)

    def pad_to_graph(self, plan: StepPlan) -> tuple[StepPlan, DecodeGraphs | PrefillGraphs | None, int | None]:
        """The plan padded to the shapes of the graph that runs it (when steps are padded; else the plan itself), that
        graph (None when graphs are off) and its size."""
        if plan.decode_only and self.buffers is not None:  # decode steps are padded whatever the backend
            padded_size = padded_batch_size(self.decode_batch_sizes, plan.num_seqs)
            return pad_decode_plan(plan, padded_size), self.graphs, padded_size
        if plan.decode_only or not self.pads_steps or plan.num_tokens > self.prefill_token_counts[-1]:
            return plan, None, None
        padded_size = padded_batch_size(self.prefill_token_counts, plan.num_tokens)
        return pad_prefill_plan(plan, padded_size, self.config.max_num_seqs), self.prefill_graphs, padded_size

    def fill_placeholders(self, inputs: StepInputs, previous: StepOutput | None) -> None:
        """Input tokens sampled by the step still in flight are taken from its samples, on the device. Only rank 0
        sampled them, so rank 0 sends them to the other ranks."""
        if self.tp.rank == 0:
            assert previous is not None and previous.sampled_token_ids is not None, "placeholder without a step"
            tokens = previous.sampled_token_ids.index_select(0, inputs.placeholder_sources)
        else:
            tokens = torch.empty(len(inputs.placeholder_rows), dtype=torch.int64, device=self.device)
        self.tp.broadcast_from_first(tokens)
        inputs.input_ids.index_copy_(0, inputs.placeholder_rows, tokens)

    def update_sampler(self, sampling: StepSampling) -> None:
        """Releases first: a slot released and taken again in one plan starts clean."""
        for slot in sampling.released_slots:
            self.sampler.release(slot)
        for request in sampling.new_requests:
            self.sampler.add_request(request.slot, request.params, request.prompt_token_ids)

    def prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> LogprobsTensors | None:
        """Logprobs of each prompt token given the tokens before it, from the raw log-softmax of the rows that
        predict it, PROMPT_LOGPROB_CHUNK rows at a time (a long prompt's logits would not fit at once). None on
        ranks other than 0, which only send their shard of each chunk's logits."""
        rows = upload_array(plan.prompt_logprob_rows, self.device)
        sampling = plan.sampling
        next_token_ids = upload_array(sampling.prompt_logprob_token_ids, self.device) if sampling is not None else None
        chunks = []
        for start in range(0, len(rows), PROMPT_LOGPROB_CHUNK):
            chunk = slice(start, start + PROMPT_LOGPROB_CHUNK)
            logits = self.model.compute_logits(hidden[rows[chunk]])
            if logits is not None:
                logprobs = logits.float().log_softmax(dim=-1)
                chunks.append(compute_logprobs(logprobs, next_token_ids[chunk], sampling.num_prompt_logprobs))
        return LogprobsTensors.concat(chunks) if chunks else None

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding counted once)."""
        return sum(param.numel() * param.element_size() for param in self.model.parameters())

    def shutdown(self) -> None:
        """Drop the graphs, the KV cache and the model, so their memory is freed; the worker runs no more steps."""
        self.graphs = self.prefill_graphs = self.kv_cache = self.model = None


def upload_array(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A plan's array on the worker's device: staged through pinned memory, asynchronously, on CUDA."""
    return array_to_device(array, device, pin_memory=device.type == "cuda")


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
    scans every object alive, and start-up leaves many: one full collection paused a benchmark's first run for
    0.30-0.41 s. Collecting now starts afresh the count that triggers the next full collection: it waits until a
    quarter as many objects again have outlived the younger collections (CPython 3.12), more than a run keeps.
    Objects built after this call count toward it: the block manager's one object per KV block (137,706 of them with
    an fp8 cache on the H200) once brought that full collection into the first run.
    (Freezing the survivors, gc.freeze(), would also keep them out of later full collections, but an engine dropped
    without shutdown() sits in reference cycles and would then never be freed, its KV cache held.)"""
    gc.collect()
