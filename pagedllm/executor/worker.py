"""Worker: the device side of the engine. It owns the model and its weights, the KV cache, the attention backend,
the CUDA graphs, the step buffers and the sampler with its per-request state, and turns a StepPlan into a StepOutput.

Under tensor parallelism every rank has a Worker holding its shard; all of them execute the same plans in the same
order (their collectives pair up that way), and only rank 0 has a sampler.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ResolvedConfig
from pagedllm.executor.cuda_graphs import (
    DecodeGraphs,
    PrefillGraphs,
    graph_batch_sizes,
    graph_token_counts,
    padded_batch_size,
)
from pagedllm.executor.kv_cache import KVCache
from pagedllm.executor.step_inputs import StepBuffers, StepInputs, pad_decode_plan, pad_prefill_plan, wrap_plan
from pagedllm.executor.step_output import StepEvents, StepOutput
from pagedllm.executor.step_plan import StepPlan, StepSampling
from pagedllm.layers.parallel_state import TensorParallelGroup
from pagedllm.models.spec import DecoderSpec
from pagedllm.sampling.batch import array_to_device
from pagedllm.sampling.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sampling.sampler import Sampler, TokenMask

# Prompt logprobs: logits of at most this many prompt rows exist at once (rows x vocab x ~12 bytes at the peak).
PROMPT_LOGPROB_CHUNK = 256


class Worker:
    """One rank's Executor (executor/executor.py). Built, and started in named phases (loaded, warmed up, its KV
    cache sized and bound, graphs captured, primed for the first request), by executor/start_up.start_worker."""

    def __init__(self, resolved: ResolvedConfig, spec: DecoderSpec, tp: TensorParallelGroup, device: torch.device):
        """resolved: the engine's settings and kernel choices; spec: the checkpoint's model; tp: this worker's rank
        and group; device: this rank's. The shapes every step runs at and, on CUDA, the step buffers; the model, the
        KV cache and the graphs come from the start-up phases."""
        config, max_model_len = resolved.config, resolved.max_model_len
        self.config, self.device, self.dtype, self.tp, self.spec = config, device, resolved.dtype, tp, spec
        self.resolved = resolved
        self.kernels = resolved.kernels  # which kernels the model, the attention backend and the sampler run
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.buffers: StepBuffers | None = None
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        if device.type == "cuda":
            table_width = -(-max_model_len // config.block_size)  # any sequence's block table fits
            self.buffers = StepBuffers(
                max_tokens, config.max_num_seqs, table_width, device, max_samples=resolved.max_sampled_rows
            )
        self.decode_batch_sizes = graph_batch_sizes(config.max_num_seqs)
        self.prefill_token_counts = graph_token_counts(max_tokens)
        # CUDA with the Triton backend: every step runs at a graph's shapes, with graphs or without (enforce_eager),
        # so that graphs on and off give bit-identical results (the same matmul shapes).
        self.pads_steps = self.buffers is not None and self.kernels.attention == "triton"
        self.record_events = False  # device timings in every StepOutput: set_device_timings
        # Set by start_up.start_worker: load_model, size_kv_cache, capture_graphs.
        self.model: nn.Module | None = None
        self.backend: AttentionBackend | None = None
        self.sampler: Sampler | None = None  # rank 0's: only rank 0 samples
        self.num_kv_blocks = 0
        self.kv_cache: KVCache | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, previous: StepOutput | None = None, masks: Callable[[], np.ndarray] | None = None
    ) -> StepOutput:
        """Queue one step on the device without waiting for it. Input tokens still unknown on the host
        (sampled by the step in flight) are taken on the device from `previous`. masks: the grammar masks of
        plan.bitmask_rows, asked for once the forward and the logits are queued, so the host fills them while the
        device computes (Executor.execute)."""
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
                mask = None
                if len(plan.bitmask_rows):
                    mask = TokenMask(upload_array(masks(), self.device), inputs.bitmask_rows)
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
        """Releases first: a state index released and taken again in one plan starts clean."""
        for state_index in sampling.released_state_indices:
            self.sampler.release(state_index)
        for request in sampling.new_requests:
            self.sampler.add_request(request.state_index, request.params, request.prompt_token_ids)
        if sampling.generator_rewinds or sampling.uncounted_tokens:
            self.sampler.take_back(sampling.generator_rewinds, sampling.uncounted_tokens)

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

    def set_device_timings(self, on: bool) -> None:
        self.record_events = on

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding counted once)."""
        return sum(param.numel() * param.element_size() for param in self.model.parameters())

    def shutdown(self) -> None:
        """Drop the graphs, the KV cache and the model, so their memory is freed; the worker runs no more steps."""
        self.graphs = self.prefill_graphs = self.kv_cache = self.model = None


def upload_array(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A plan's array on the worker's device: staged through pinned memory, asynchronously, on CUDA."""
    return array_to_device(array, device, pin_memory=device.type == "cuda")
