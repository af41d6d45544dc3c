"""LLMEngine: add requests, step the scheduler and the worker, and turn finished work into RequestOutputs."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.config import EngineConfig, resolve_device, resolve_dtype
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_processor import process_prompt
from pagedllm.engine.step_pipeline import StepPipeline, StepRecord
from pagedllm.executor.distributed_executor import make_executor
from pagedllm.executor.ranks import is_rank_zero
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.models.spec import DecoderSpec
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import Sequence
from pagedllm.trace.tracer import Tracer


@dataclass(slots=True)
class Request:
    seq: Sequence
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool  # report every step's progress, not only the finished request
    detokenizer: IncrementalDetokenizer | None  # None with skip_tokenizer_init


def eos_token_ids(hf_config, tokenizer, generation_config) -> frozenset[int]:
    ids: set[int] = set()
    sources = (
        getattr(generation_config, "eos_token_id", None),
        hf_config.eos_token_id,
        getattr(tokenizer, "eos_token_id", None),
    )
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        load_tokenizer = not config.skip_tokenizer_init
        checkpoint = open_checkpoint(config.model, config.tokenizer, load_tokenizer, convert_gguf=is_rank_zero())
        self.spec = DecoderSpec.from_hf_config(checkpoint.hf_config)
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.spec)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, checkpoint.checkpoint_dtype)
        # Under torchrun, on ranks other than 0 this serves rank 0 and exits the process.
        self.worker = make_executor(config, self.spec, self.max_model_len, device, dtype, checkpoint)
        self.block_manager = BlockManager(self.worker.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.eos_token_ids = eos_token_ids(checkpoint.hf_config, self.tokenizer, checkpoint.generation_config)
        self.requests: dict[str, Request] = {}
        self.request_counter = itertools.count()
        self.async_scheduling = device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        self.pipeline = StepPipeline(self.scheduler, self.worker, overlap=self.async_scheduling)
        # Called with each step's record once its tokens are back (progress bars, benchmarks, traces).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.tracer: Tracer | None = None
        if config.trace_file is not None:
            self.start_trace(os.fspath(config.trace_file), config.trace_kv_every)

    def add_step_listener(self, listener: Callable[[StepRecord], None], device_timings: bool = False) -> None:
        """device_timings: records carry marks around each step's device work (CUDA events on a GPU, host clock
        readings on CPU; a few events a step)."""
        self.step_listeners.append(listener)
        self.worker.record_events |= device_timings

    def remove_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        self.step_listeners.remove(listener)

    def start_trace(self, path: str | None, kv_every: int | None = None) -> Tracer:
        """Trace every step and request from now on (pagedllm/trace/tracer.py); path None keeps it in memory."""
        self.stop_trace()
        metadata = {"model": self.config.model or "default", "block_size": self.config.block_size}
        self.tracer = Tracer(path, self.worker.device, self.block_manager.num_blocks, kv_every, metadata)
        self.pipeline.describe_step = self.tracer.describe_step
        self.add_step_listener(self.tracer.on_step, device_timings=True)
        return self.tracer

    def stop_trace(self) -> None:
        """Detach the tracer (writing its file one last time): no per-step work is left behind."""
        if self.tracer is not None:
            self.remove_step_listener(self.tracer.on_step)
            self.pipeline.describe_step = None
            self.worker.record_events = False  # the tracer is the only listener that asks for device timings
            self.tracer.close()
            self.tracer = None

    def write_trace(self) -> None:
        if self.tracer is not None and self.tracer.path is not None:
            self.tracer.save()

    def next_request_id(self) -> str:
        return str(next(self.request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams | None = None,
        stream: bool = True,
    ) -> None:
        """Validate and queue one request. Raises ValueError (and queues nothing) for bad input.
        stream=False: step() reports this request only when it finishes."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        self.validate_length(token_ids, params)
        seq = Sequence(request_id, token_ids, params, eos_token_ids=self.eos_token_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids) if self.tokenizer is not None else None
        self.requests[request_id] = Request(seq, text, list(token_ids), stream, detokenizer)
        self.scheduler.add(seq)
        if self.tracer is not None:
            self.tracer.request_arrived(seq)

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        return process_prompt(prompt, self.tokenizer, self.spec.vocab_size)

    def validate_length(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter to leave room for at least one generated token"
            )
        longest = self.max_model_len if params.max_tokens is None else len(token_ids) + params.max_tokens
        blocks_needed = self.block_manager.blocks_for_tokens(min(longest, self.max_model_len))
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"this request can grow to {min(longest, self.max_model_len)} tokens ({blocks_needed} KV blocks), "
                f"but the KV cache holds only {self.block_manager.num_blocks} blocks of {self.config.block_size}; "
                "lower max_tokens or raise num_kv_blocks / kv_cache_memory_bytes"
            )

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request_id)
            self.pipeline.forget(request_id)
            if self.tracer is not None:
                self.tracer.request_finished(request.seq)

    def shutdown(self) -> None:
        """End the executor: its rank processes under tensor parallelism, and the device memory it holds."""
        self.worker.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.pipeline.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every streamed request that produced a token this step
        and for every request that finished.

        With async scheduling, step N+1 is queued on the device before step N's tokens are read back, so the
        host's bookkeeping overlaps the device's work; outputs then trail the device by one step.
        """
        record, resolved = self.pipeline.step()
        outputs = []
        for seq, token_id in resolved:
            request = self.requests[seq.request_id]
            if request.detokenizer is not None:
                request.detokenizer.add(token_id)
            if request.stream or seq.is_finished:
                outputs.append(self.make_output(request))
            if seq.is_finished:
                del self.requests[seq.request_id]
                self.pipeline.forget(seq.request_id)
                if self.tracer is not None:
                    self.tracer.request_finished(seq)
        if record is not None:
            for listener in self.step_listeners:
                listener(record)
        return outputs

    def make_output(self, request: Request) -> RequestOutput:
        seq = request.seq
        text = request.detokenizer.text if request.detokenizer is not None else ""
        completion = CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
        )


def resolve_max_model_len(requested: int | None, spec: DecoderSpec) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window:  # attention is exact only while the whole context fits in the window
        limit = min(limit, spec.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} positions")
    return requested
