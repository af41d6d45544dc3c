"""Worker: the device side of the engine. It owns the model and its weights, the KV cache, the attention backend,
the CUDA graphs, the step buffers and per-request random state, and turns a StepPlan into a StepOutput.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.selector import select_backend
from pagedllm.config import EngineConfig
from pagedllm.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_batch_size
from pagedllm.executor.kv_cache import KVCache, allocate_kv_cache, bind_kv_cache, choose_num_kv_blocks, kv_block_bytes
from pagedllm.executor.step_inputs import StepBuffers, pad_decode_plan, wrap_plan
from pagedllm.executor.step_output import StepEvents, StepOutput
from pagedllm.executor.step_plan import SamplingArrays, StepPlan
from pagedllm.layers.parallel_state import tp_size
from pagedllm.layers.sampler import SamplingTensors, sample
from pagedllm.loader.checkpoint import Checkpoint, open_checkpoint
from pagedllm.loader.weights import load_weights
from pagedllm.logger import logger
from pagedllm.models.registry import build_model
from pagedllm.models.spec import DecoderSpec


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        checkpoint: Checkpoint | None = None,
    ):
        """checkpoint: already opened by the caller (rank 0 reads config and tokenizer from it), else opened here."""
        checkpoint = checkpoint or open_checkpoint(config.model, config.tokenizer, load_tokenizer=False)
        self.config, self.device, self.dtype = config, device, dtype
        self.spec = DecoderSpec.from_hf_config(checkpoint.hf_config)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # On CUDA every block table is as wide as max_model_len needs, so the graphs' buffers always fit.
        self.table_width = -(-max_model_len // config.block_size) if device.type == "cuda" else None
        self.buffers: StepBuffers | None = None
        if device.type == "cuda":
            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.buffers = StepBuffers.allocate(max_tokens, config.max_num_seqs, self.table_width, device)
        self.decode_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.graphs: DecodeGraphs | None = None
        self.model = build_model(self.spec, max_model_len, dtype, device)
        load_weights(self.model, checkpoint.named_tensors(dtype), checkpoint.source)
        self.backend = select_backend(config.attention_backend, device, self.spec.head_dim, config.kv_cache_dtype)
        self.generators: dict[str, torch.Generator] = {}  # request id -> its own stream, for seeded requests
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.record_events = False  # set by the engine when someone wants device timings
        block_bytes = kv_block_bytes(self.spec, config.block_size, dtype, tp_size(), config.kv_cache_dtype)
        self.num_kv_blocks = choose_num_kv_blocks(config, block_bytes, max_model_len, device, self.warmup)
        self.kv_cache = self.bind_kv_cache(self.num_kv_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB%s) on %s; attention backend %s",
            self.num_kv_blocks, config.block_size, self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * block_bytes / 2**30, ", fp8" if config.kv_cache_dtype == "fp8" else "", device,
            self.backend.name,
        )  # fmt: skip
        if self.buffers is not None and not config.enforce_eager and self.backend.name == "triton":
            self.graphs = DecodeGraphs(self.model, self.buffers, config.max_num_seqs, max_model_len)
            self.graphs.capture()

    def bind_kv_cache(self, num_blocks: int) -> KVCache:
        kv_cache = allocate_kv_cache(
            self.spec, num_blocks, self.block_size, self.dtype, self.device, tp_size(), self.config.kv_cache_dtype
        )
        bind_kv_cache(self.model, kv_cache, self.backend)
        return kv_cache

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the largest prefill step and the largest decode step once, on a throwaway cache."""
        seq_len = min(self.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // seq_len))
        blocks_per_seq = -(-seq_len // self.block_size)
        num_prefill_blocks = num_seqs * blocks_per_seq
        self.bind_kv_cache(num_prefill_blocks + self.config.max_num_seqs)
        prefill_tables = np.arange(num_prefill_blocks, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        self.execute(self.synthetic_plan(prefill_tables, seq_len))
        decode_tables = num_prefill_blocks + np.arange(self.config.max_num_seqs, dtype=np.int32)[:, None]
        self.execute(self.synthetic_plan(decode_tables, 1))
        self.bind_kv_cache(0)  # drop the throwaway cache before free memory is measured

    def synthetic_plan(self, block_tables: np.ndarray, seq_len: int) -> StepPlan:
        """Every sequence computes seq_len tokens of id 0 from scratch and samples with top-k and top-p on."""
        num_seqs = len(block_tables)
        positions = np.tile(np.arange(seq_len, dtype=np.int64), num_seqs)
        rows = np.repeat(np.arange(num_seqs), seq_len)
        slots = block_tables[rows, positions // self.block_size].astype(np.int64) * self.block_size
        if self.table_width is not None:
            block_tables = np.pad(block_tables, ((0, 0), (0, self.table_width - block_tables.shape[1])))
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32) * seq_len
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
            placeholder_rows=np.zeros(0, dtype=np.int64),
            placeholder_sources=np.zeros(0, dtype=np.int64),
            sampling=SamplingArrays(
                temperatures=np.ones(num_seqs, dtype=np.float32),
                top_ps=np.full(num_seqs, 0.9, dtype=np.float32),
                top_ks=np.full(num_seqs, 50, dtype=np.int64),
                seeds=[None] * num_seqs,
                request_ids=[""] * num_seqs,
            ),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous: StepOutput | None = None) -> StepOutput:
        """Queue one step on the device without waiting for it. Input tokens still unknown on the host
        (sampled by the step in flight) are taken on the device from `previous`."""
        self.release(plan.finished_request_ids)
        padded_size = None
        if self.buffers is not None and plan.decode_only:
            # A CUDA decode step runs at a graph batch size, with graphs or without: the same matmul shapes make
            # graphs on and off give bit-identical results.
            padded_size = padded_batch_size(self.decode_batch_sizes, plan.num_seqs)
            pad_decode_plan(plan, padded_size)
        events = StepEvents.create(self.device) if self.record_events else None
        if events is not None:
            events.start.record()
        inputs = self.buffers.upload(plan) if self.buffers is not None else wrap_plan(plan)
        if len(plan.placeholder_rows):
            assert previous is not None and previous.sampled_token_ids is not None, "placeholder without a step"
            placeholders = previous.sampled_token_ids.index_select(0, inputs.placeholder_sources)
            inputs.input_ids.index_copy_(0, inputs.placeholder_rows, placeholders)
        if padded_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(padded_size)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if events is not None:
            events.forward_done.record()
        sampled = None
        if plan.num_sampled:
            logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
            sampled = sample(logits, self.sampling_tensors(plan.sampling, inputs.sampling))
        if events is not None:
            events.end.record()
        return StepOutput(plan.step_id, sampled, events)

    def sampling_tensors(self, arrays: SamplingArrays, inputs) -> SamplingTensors:
        temperatures = arrays.temperatures
        return SamplingTensors(
            temperatures=inputs.temperatures,
            top_ps=inputs.top_ps,
            top_ks=inputs.top_ks,
            generators=[self.generator_for(key, seed) for key, seed in zip(arrays.request_ids, arrays.seeds)],
            default_generator=self.default_generator,
            all_greedy=bool((temperatures == 0).all()),
            any_greedy=bool((temperatures == 0).any()),
        )

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return generator

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)
