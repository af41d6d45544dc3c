"""LLMEngine: add requests, step the scheduler and the worker, and turn their results into RequestOutputs: text
(with stop strings), logprobs, and the n completions of a request."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.grammars import GrammarRequests, RejectedRequest
from pagedllm.engine.input_processor import process_prompt
from pagedllm.engine.step_pipeline import NewToken, StepPipeline, StepRecord
from pagedllm.executor.distributed_executor import make_executor
from pagedllm.executor.executor import Executor
from pagedllm.executor.ranks import is_rank_zero
from pagedllm.executor.start_up import collect_start_up_garbage, weights_to_load
from pagedllm.loader.checkpoint import open_checkpoint
from pagedllm.models.spec import DecoderSpec
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling.params import SamplingParams, model_sampling_defaults
from pagedllm.scheduler.block_manager import BlockManager
from pagedllm.scheduler.scheduler import Scheduler
from pagedllm.scheduler.sequence import Sequence
from pagedllm.spec_decode.metrics import SpecDecodeStats
from pagedllm.spec_decode.speculator import make_speculator
from pagedllm.trace.tracer import Tracer

# When no step has work, how long step() waits for a grammar to compile before it returns.
GRAMMAR_WAIT_S = 0.01


@dataclass(slots=True)
class Sample:
    """One of a request's n completions."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None with skip_tokenizer_init
    # A request nobody reads while it runs (stream=False) and that has no stop strings: its text is decoded once,
    # when it ends, not token by token in every step (the same text; a step's host time is what paces the device).
    text_at_end: bool
    logprobs: list[PositionLogprobs] | None  # one entry per token, when logprobs were asked for
    cumulative_logprob: float | None


@dataclass(slots=True)
class Request:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]  # samples[i] has CompletionOutput.index i
    stream: bool  # report every step's progress, not only the finished request
    prompt_logprobs: list[PositionLogprobs | None] | None  # None for the first prompt token; when asked for

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of a request: n = 1, seed + i (vLLM's rule for n > 1); only sample 0 computes prompt logprobs."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


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
    grammars: GrammarRequests | None = None  # structured requests waiting for their grammar; at the first one

    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        """executor: what runs the steps. None: built from the resolved config, a Worker, or a DistributedExecutor
        for several ranks. A given one (a stand-in without a device, as in tests and benchmarks) is used as it is:
        its num_kv_blocks sizes the block manager."""
        load_tokenizer = not config.skip_tokenizer_init
        checkpoint = open_checkpoint(
            config.model, config.tokenizer, load_tokenizer, write_cache=is_rank_zero(), gguf_file=config.gguf_file
        )
        self.spec = DecoderSpec.from_hf_config(checkpoint.hf_config)
        self.tokenizer = checkpoint.tokenizer
        self.resolved = resolved = config.resolve(self.spec, checkpoint.checkpoint_dtype, checkpoint.weights_format)
        checkpoint = weights_to_load(checkpoint, resolved, write_cache=is_rank_zero())
        self.config = config = resolved.config  # every default made concrete
        self.max_model_len = resolved.max_model_len
        torch.set_num_threads(resolved.threads)  # before the executor: CPU tensor-parallel ranks share them out
        # Speculative decoding: a draft model is checked before anything starts, and loaded once the cache is sized.
        self.speculator = make_speculator(resolved, self.spec, self.tokenizer)
        # Under torchrun, on ranks other than 0 make_executor serves rank 0 and exits the process.
        if executor is None:  # the target's cache leaves a draft model its share
            companion = self.speculator.memory() if self.speculator is not None else None
            executor = make_executor(resolved, self.spec, checkpoint, companion)
        self.worker = executor
        self.block_manager = BlockManager(self.worker.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.eos_token_ids = eos_token_ids(checkpoint.hf_config, self.tokenizer, checkpoint.generation_config)
        # What the model's generation_config says to sample with (LLM.get_default_sampling_params, chat's defaults)
        self.model_sampling_defaults = model_sampling_defaults(checkpoint.generation_config)
        self.requests: dict[str, Request] = {}
        self.request_counter = itertools.count()
        self.async_scheduling = resolved.async_scheduling
        self.token_texts: dict[int, str] = {}  # decoded_token of logprobs, per token id
        decode = self.decode_token if self.tokenizer is not None else None
        self.spec_decode_stats: SpecDecodeStats | None = None  # the totals of every step, while speculating
        if self.speculator is not None:
            self.speculator.start(self.worker.num_kv_blocks)
            self.spec_decode_stats = SpecDecodeStats()
        self.pipeline = StepPipeline(
            self.scheduler, self.worker, overlap=self.async_scheduling, decode=decode, speculator=self.speculator
        )
        # Called with each step's record once its tokens are back (progress bars, benchmarks, traces).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        # Those of them that asked for device timings: the executor records them while any is attached.
        self.timed_listeners: list[Callable[[StepRecord], None]] = []
        if self.spec_decode_stats is not None:
            self.step_listeners.append(self.spec_decode_stats.add)
        self.tracer: Tracer | None = None
        if config.trace_file is not None:
            self.start_trace(os.fspath(config.trace_file), config.trace_kv_every)
        collect_start_up_garbage()  # last: start-up's garbage, and what it built (the blocks) counts as old

    def add_step_listener(self, listener: Callable[[StepRecord], None], device_timings: bool = False) -> None:
        """device_timings: records carry marks around each step's device work (CUDA events on a GPU, host clock
        readings on CPU; a few events a step) until this listener is removed."""
        self.step_listeners.append(listener)
        if device_timings:
            self.timed_listeners.append(listener)
            self.worker.set_device_timings(True)

    def remove_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        self.step_listeners.remove(listener)
        if listener in self.timed_listeners:
            self.timed_listeners.remove(listener)
            self.worker.set_device_timings(bool(self.timed_listeners))

    def start_trace(self, path: str | None, kv_every: int | None = None) -> Tracer:
        """Trace every step and request from now on (pagedllm/trace/tracer.py); path None keeps it in memory."""
        self.stop_trace()
        metadata = {"model": self.config.model or "default", "block_size": self.config.block_size}
        self.tracer = Tracer(path, self.worker.device, self.block_manager.num_blocks, kv_every, metadata)
        self.pipeline.describe_step = self.tracer.describe_step
        self.add_step_listener(self.tracer.on_step, device_timings=True)
        return self.tracer

    def stop_trace(self) -> None:
        """Detach the tracer (writing its file one last time): no per-step work is left behind, and device timings
        stay on only for other listeners that asked for them."""
        if self.tracer is not None:
            self.remove_step_listener(self.tracer.on_step)
            self.pipeline.describe_step = None
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
        self.validate_params(params)
        text, token_ids = self.tokenize(prompt)
        self.validate_length(token_ids, params)
        seqs = [
            Sequence(request_id, list(token_ids), sample_params(params, index), self.eos_token_ids, sample_index=index)
            for index in range(params.n)
        ]
        seqs[0].forks = seqs[1:]  # they fork from sample 0 once its prompt is computed
        wants_logprobs = params.logprobs is not None
        samples = []
        for seq in seqs:
            detokenizer = self.make_detokenizer(token_ids, seq.sampling_params)
            text_at_end = not stream and detokenizer is not None and detokenizer.can_decode_at_end()
            logprobs, cumulative_logprob = ([], 0.0) if wants_logprobs else (None, None)
            samples.append(Sample(seq, detokenizer, text_at_end, logprobs, cumulative_logprob))
        prompt_logprobs = [None] * len(token_ids) if params.prompt_logprobs is not None else None
        if params.structured_outputs is not None:  # waits outside the scheduler while its grammar compiles
            self.structured_requests().add(request_id, seqs[0])
        else:
            self.scheduler.add(seqs[0])
        self.requests[request_id] = Request(text, list(token_ids), samples, stream, prompt_logprobs)
        if self.tracer is not None:
            self.tracer.request_arrived(seqs[0])  # one track per request: sample 0 stands for the others

    def make_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if self.tokenizer is not None else None

    def validate_params(self, params: SamplingParams) -> None:
        params.validate_for_model(self.spec.vocab_size)
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples cannot run at once with max_num_seqs={self.config.max_num_seqs}; "
                "lower n or raise max_num_seqs"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True; use stop_token_ids")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer, but skip_tokenizer_init=True")

    def structured_requests(self) -> GrammarRequests:
        """Made at the first structured request, which starts loading the backend."""
        if self.grammars is None:
            self.grammars = GrammarRequests(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        return self.grammars

    def waits_for_grammar(self, request_id: str) -> bool:
        """The request is added, and waits for its grammar to compile: not scheduled yet."""
        return self.grammars is not None and request_id in self.grammars

    def take_rejected(self) -> list[RejectedRequest]:
        """Requests whose constraint could not be compiled since the last call (a bad schema, regex or grammar, no
        llguidance): each is gone from the engine, and its error says what is wrong; every other request runs on."""
        if self.grammars is None:
            return []
        rejected, self.grammars.rejected = self.grammars.rejected, []
        return rejected

    def admit_compiled(self) -> None:
        """Schedule the requests whose grammar is ready; drop those whose grammar failed (take_rejected() reports
        them). When nothing runs, wait a little for a compile, rather than spin."""
        timeout = 0.0 if self.pipeline.has_work() else GRAMMAR_WAIT_S
        ready, rejected = self.grammars.take_finished(timeout)
        for seq in ready:
            self.scheduler.add(seq)
        for rejection in rejected:
            request = self.requests.pop(rejection.request_id)
            if self.tracer is not None:
                self.tracer.request_finished(request.samples[0].seq)

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
            if self.grammars is not None:
                self.grammars.abort(request_id)
            self.scheduler.abort(request_id)
            if self.tracer is not None:
                self.tracer.request_finished(request.samples[0].seq)

    def shutdown(self) -> None:
        """End the executor: its rank processes under tensor parallelism, and the device memory it holds."""
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        self.worker.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.pipeline.has_work() or bool(self.grammars)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every streamed request that produced a token this step
        and for every request that finished.

        With async scheduling, step N+1 is queued on the device before step N's tokens are read back, so the
        host's bookkeeping overlaps the device's work; outputs then trail the device by one step.
        """
        if self.grammars:
            self.admit_compiled()
        result = self.pipeline.step()
        for computed in result.prompt_logprobs:
            request = self.requests[computed.seq.request_id]
            start = computed.first_position + 1
            request.prompt_logprobs[start : start + len(computed.positions)] = computed.positions
        progressed: dict[str, Request] = {}
        # Requests a sample of which ended with its token of this step: only these can have finished (a request's
        # other samples ended before; an aborted request is gone from self.requests).
        ended: set[str] = set()
        for token in result.tokens:
            seq = token.seq
            if token.position >= seq.num_tokens:
                continue  # a verify step's token after one that ended the sequence (a stop string, its grammar)
            request = self.requests[seq.request_id]
            self.take_token(request.samples[seq.sample_index], token)
            progressed[seq.request_id] = request
            if seq.is_finished:
                ended.add(seq.request_id)
        outputs = []
        for request_id, request in progressed.items():
            finished = request_id in ended and request.finished
            if request.stream or finished:
                outputs.append(self.make_output(request_id, request))
            if finished:
                del self.requests[request_id]
                if self.tracer is not None:
                    self.tracer.request_finished(request.samples[0].seq)
        if result.record is not None:
            for listener in self.step_listeners:
                listener(result.record)
        return outputs

    def take_token(self, sample: Sample, token: NewToken) -> None:
        """Logprobs, text and stop strings for one new token (already appended to the sequence, and taken by its
        grammar's matcher: StepPipeline.follow_tokens; a verify step appends several, taken here one by one: only the
        last can be the one that ended the sequence)."""
        seq = sample.seq
        position = token.position if token.position >= 0 else seq.num_tokens - 1
        ended_by_token = token.ended_by_token  # EOS or a stop token: its text is left out
        if sample.logprobs is not None:
            sample.logprobs.append(token.logprobs)
            sample.cumulative_logprob += token.logprobs[token.token_id].logprob
        ended = seq.is_finished and position == seq.num_tokens - 1  # its grammar may have ended it here
        if sample.detokenizer is None:
            return
        if sample.text_at_end:
            if ended:
                sample.detokenizer.decode_all(seq.output_token_ids, stop_terminated=ended_by_token)
            return
        stop = sample.detokenizer.update([token.token_id], stop_terminated=ended_by_token)
        if stop is not None:  # the text reached a stop string: the sequence ends here
            if ended:  # at its length limit on the same token: the stop string names the reason
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:  # tokens a verify step appended after it are dropped
                self.scheduler.finish(seq, "stop", stop_reason=stop, num_tokens=position + 1)
                ended = True
        if ended:
            sample.detokenizer.finish()

    def decode_token(self, token_id: int) -> str:
        """A token's own text (Logprob.decoded_token); the token's name where it is part of a character."""
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if "\ufffd" in text:
                text = self.tokenizer.convert_ids_to_tokens(token_id)
            self.token_texts[token_id] = text
        return text

    def make_output(self, request_id: str, request: Request) -> RequestOutput:
        completions = []
        for index, sample in enumerate(request.samples):
            seq = sample.seq
            token_ids = seq.output_token_ids
            if seq.pending_sample_index >= 0:  # the placeholder of the step in flight is no token yet
                token_ids = token_ids[:-1]
            text = sample.detokenizer.output_text(seq.is_finished) if sample.detokenizer is not None else ""
            logprobs = None if sample.logprobs is None else list(sample.logprobs)
            completions.append(
                CompletionOutput(
                    index, text, token_ids, seq.finish_reason, sample.cumulative_logprob, logprobs, seq.stop_reason
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=max(request.samples[0].seq.num_cached_tokens, 0),
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
        )
