"""AsyncLLM: the engine for asyncio programs (the OpenAI server, Python users). The engine core steps in its own
process (or a thread); each request streams its outputs through an async iterator, and a request whose consumer
stops listening or is cancelled is aborted at once, its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import multiprocessing
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.entrypoints.openai import serve_extra_missing

try:
    import msgspec
    import zmq
except ModuleNotFoundError as error:
    raise serve_extra_missing("AsyncLLM", error) from None

from pagedllm.config import EngineConfig
from pagedllm.engine.input_processor import process_prompt
from pagedllm.entrypoints.openai.core_loop import (
    AbortRequests,
    AddRequest,
    CoreOutput,
    EncodedLogprobs,
    EngineStats,
    Ready,
    RequestDelta,
    Shutdown,
    StartupFailed,
    StepOutputs,
    core_process_main,
    run_core_loop,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling.params import SamplingParams

STARTUP_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


class EngineDeadError(RuntimeError):
    """The engine core stopped (crashed or was shut down); no request can be served any more."""


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int  # of all its samples
    max_num_generation_tokens: int  # of its longest sample
    e2e_latency: float  # seconds from add_request to the last token
    queue_time: float  # add_request to first scheduled
    prefill_time: float  # first scheduled to first token
    decode_time: float  # first token to last token


@dataclass(slots=True)
class TokenStats:
    """What one output of a request brought: its prompt's counts with its first output, else zeros."""

    num_prompt_tokens: int
    num_cached_tokens: int  # of the prompt tokens, those found in the prefix cache
    num_new_tokens: int
    ttft: float | None  # seconds from add_request to this output, with the first output
    itl: float | None  # seconds since the previous output that brought tokens


class StatsListener(Protocol):
    """What the server's metrics implement; AsyncLLM calls it from the event loop."""

    def record_engine_stats(self, stats: EngineStats) -> None: ...
    def record_tokens(self, tokens: TokenStats) -> None: ...
    def record_finished(self, request: FinishedRequestStats) -> None: ...


def decode_logprobs(positions: EncodedLogprobs) -> list:
    """Plain tuples from the core -> [{token_id: Logprob}] (an empty position, the first prompt token, -> None)."""
    return [
        {token_id: Logprob(logprob, rank, text) for token_id, logprob, rank, text in entry} if entry else None
        for entry in positions
    ]


@dataclass(slots=True)
class CompletionState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def snapshot(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            stop_reason=self.stop_reason,
        )


class RequestStream:
    """One request's outputs: deltas from the core merged into cumulative RequestOutputs, vLLM's shape.
    Iterate it (async for) to receive them; the iteration ends when the request finishes or is aborted."""

    def __init__(self, llm: AsyncLLM, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.llm = llm
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending: list[RequestDelta] = []
        self.wakeup = asyncio.Event()
        self.failure: BaseException | None = None
        self.finished = False  # finished, aborted or failed: nothing more will arrive
        self.completions: dict[int, CompletionState] = {}
        self.prompt_logprobs: list | None = None
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generation_tokens = 0
        self.num_tokens_per_sample: dict[int, int] = {}  # as the outputs arrive (merge() runs when they are read)

    def push(self, delta: RequestDelta) -> None:
        self.pending.append(delta)
        self.wakeup.set()

    def end(self, failure: BaseException | None = None) -> None:
        self.finished = True
        self.failure = failure
        if not self.accepted.done():
            self.accepted.set_exception(failure or EngineDeadError("the request was aborted before it started"))
            self.accepted.exception()  # mark retrieved: nobody may be waiting for it
        self.wakeup.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self.wakeup.wait()
                self.wakeup.clear()
                deltas, self.pending = self.pending, []
                if deltas:
                    for delta in deltas:
                        self.merge(delta)
                    output = self.snapshot(finished=deltas[-1].finished)
                    yield output
                    if output.finished:
                        return
                if self.failure is not None:
                    raise self.failure
                if self.finished and not self.pending:
                    return
        finally:
            self.llm.abort(self.request_id)  # no-op once finished

    def merge(self, delta: RequestDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
            self.first_scheduled_time = delta.first_scheduled_time
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs = decode_logprobs(delta.prompt_logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        for change in delta.completions:
            state = self.completions.setdefault(change.index, CompletionState(change.index))
            state.text += change.text
            state.token_ids.extend(change.token_ids)
            state.finish_reason = change.finish_reason
            state.stop_reason = change.stop_reason
            state.cumulative_logprob = change.cumulative_logprob
            if change.logprobs is not None:
                state.logprobs = (state.logprobs or []) + decode_logprobs(change.logprobs)

    def snapshot(self, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.completions[index].snapshot() for index in sorted(self.completions)],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


class AsyncLLM:
    """An LLM for asyncio programs: `async for output in llm.generate(prompt, params)`, many requests at once.

    `model` and the keywords are LLM's (EngineConfig fields). `num_threads` sets torch's CPU threads in the core.
    `core_in_thread=True` steps the engine in a thread of this process instead of its own process (slower under
    HTTP load: see benchmarks/NOTES.md, "Serving"). Call shutdown() (or use `with AsyncLLM(...) as llm`) to stop it.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        num_threads: int | None = None,
        core_in_thread: bool = False,
        stats_listener: StatsListener | None = None,
        **kwargs,
    ):
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.stats_listener = stats_listener
        self.streams: dict[str, RequestStream] = {}
        self.stats: EngineStats | None = None
        self.dead: EngineDeadError | None = None
        self.request_counter = itertools.count()
        self.id_prefix = f"pagedllm-{uuid.uuid4().hex[:8]}-"
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreOutput)
        self.loop: asyncio.AbstractEventLoop | None = None  # where outputs are delivered
        self.closing = False
        self.work_dir = tempfile.mkdtemp(prefix="pagedllm-")  # ipc sockets and the saved tokenizer
        self.context = zmq.Context()
        if core_in_thread:
            input_address, output_address = f"inproc://{self.id_prefix}in", f"inproc://{self.id_prefix}out"
        else:
            input_address, output_address = f"ipc://{self.work_dir}/in", f"ipc://{self.work_dir}/out"
        # No high-water marks: a burst of requests or outputs queues up instead of blocking either side.
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_address)
        core_args = (self.config, input_address, output_address, f"{self.work_dir}/tokenizer", num_threads)
        if core_in_thread:
            self.core = threading.Thread(
                target=run_core_loop, args=core_args, kwargs={"context": self.context}, daemon=True
            )
        else:
            # A daemonic process may not start processes of its own, as a tensor-parallel core does for its ranks:
            # such a core is not daemonic, and interpreter exit ends it through shutdown() instead.
            daemon = self.config.tensor_parallel_size == 1
            self.core = multiprocessing.get_context("spawn").Process(
                target=core_process_main, args=core_args, daemon=daemon, name="pagedllm-engine-core"
            )
            if not daemon:
                atexit.register(self.shutdown)
        self.core.start()
        try:
            self.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.reader = threading.Thread(target=self.read_outputs, daemon=True, name="pagedllm-output-reader")
        self.reader.start()

    def wait_until_ready(self) -> None:
        while not self.output_socket.poll(timeout=500):
            if not self.core.is_alive():
                raise EngineDeadError("the engine core exited while starting; see its log above")
        message = self.decoder.decode(self.output_socket.recv())
        if isinstance(message, StartupFailed):
            raise STARTUP_ERRORS.get(message.error_type, RuntimeError)(message.message)
        assert isinstance(message, Ready), f"unexpected first message from the engine core: {message!r}"
        self.max_model_len = message.max_model_len
        self.vocab_size = message.vocab_size
        self.num_kv_blocks = message.num_kv_blocks
        self.eos_token_ids = frozenset(message.eos_token_ids)
        self.tokenizer = None
        if message.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(message.tokenizer_dir)

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # --- requests ---------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """A prompt (str, {"prompt": str} or {"prompt_token_ids": [...]}, optionally with "prompt") -> (text, token
        ids), checked as LLM checks them (ids within the vocabulary, text valid Unicode). It may take seconds for a
        long text: the server calls it in a worker thread."""
        return process_prompt(prompt, self.tokenizer, self.vocab_size)

    async def add_request(
        self, prompt: str | dict, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Queue one request; returns its stream once the engine core has accepted it. Raises ValueError or
        TypeError (and queues nothing) for bad input, EngineDeadError when the core has stopped."""
        if self.dead is not None:
            raise self.dead
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id or f"{self.id_prefix}{next(self.request_counter)}"
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = self.tokenize(prompt)  # ids only: quick
        else:  # text: seconds for megabytes, off the event loop
            text, token_ids = await asyncio.to_thread(self.tokenize, prompt)
        params.validate_for_model(self.vocab_size)
        message = self.encode_request(AddRequest(request_id, text, token_ids, params))
        self.watch_loop()
        stream = RequestStream(self, request_id, text, token_ids)
        self.streams[request_id] = stream
        try:
            self.send_encoded(message)
            await stream.accepted
        except BaseException:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, prompt: str | dict, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (cumulative, as vLLM's); leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; its stream ends. Unknown or finished ids are ignored."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        stream.end()
        if self.dead is None:
            with contextlib.suppress(EngineDeadError):  # called from finally blocks: a stopped core frees all anyway
                self.send(AbortRequests([request_id]))
            self.record_finished(stream, "abort")

    def abort_all(self) -> None:
        """End every request (the server calls this on SIGINT/SIGTERM so streams finish at once)."""
        for request_id in list(self.streams):
            self.abort(request_id)

    def encode_request(self, message: AddRequest) -> bytes:
        """The message for the core, or a ValueError for a value msgpack cannot carry (checked before the request
        is registered, so a refused request leaves nothing behind)."""
        try:
            return self.encoder.encode(message)
        except OverflowError:
            raise ValueError(
                "an integer of this request (n, seed, a token id ...) is outside [-2**63, 2**64 - 1]: it cannot be "
                "sent to the engine core"
            ) from None
        except UnicodeEncodeError as error:
            raise ValueError(
                f"a string of this request (a stop string?) is not valid Unicode: {error.reason}"
            ) from None

    def send(self, message) -> None:
        self.send_encoded(self.encoder.encode(message))

    def send_encoded(self, message: bytes) -> None:
        try:  # never blocks: with the core connected nothing is dropped (no high-water mark); without it, Again
            self.input_socket.send(message, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine core is not connected (it stopped)") from None

    # --- outputs ----------------------------------------------------------------------------------------------

    def watch_loop(self) -> None:
        """Deliver outputs to the running event loop (the one that adds requests)."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            self.loop = loop

    def read_outputs(self) -> None:
        """The output reader thread: it owns the output socket, decodes each message and hands it to the event
        loop, in order. It ends at shutdown, or tells every stream when the core died."""
        try:
            while not self.closing:
                if not self.output_socket.poll(timeout=200):
                    if not self.core.is_alive() and not self.closing:
                        self.call_in_loop(self.fail_all, EngineDeadError("the engine core stopped unexpectedly"))
                        return
                    continue
                message = self.decoder.decode(self.output_socket.recv(copy=False))
                if isinstance(message, StepOutputs):
                    self.call_in_loop(self.dispatch, message)
        finally:
            self.output_socket.close(linger=0)

    def call_in_loop(self, function, *args) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            if isinstance(args[0], StepOutputs):
                self.stats = args[0].stats  # no request in flight: keep the statistics current all the same
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(function, *args)

    def dispatch(self, message: StepOutputs) -> None:
        now = time.monotonic()
        self.stats = message.stats
        listener = self.stats_listener
        if listener is not None:
            listener.record_engine_stats(message.stats)
        for request_id in message.accepted:
            stream = self.streams.get(request_id)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_result(None)
        for rejection in message.rejected:
            stream = self.streams.pop(rejection.request_id, None)
            if stream is not None:
                error_class = TypeError if rejection.error_type == "TypeError" else ValueError
                stream.end(error_class(rejection.message))
        for delta in message.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue  # aborted meanwhile
            self.record_progress(stream, delta, now)
            stream.push(delta)
            if delta.finished:
                del self.streams[delta.request_id]
                stream.finished = True
                reasons = [c.finish_reason for c in delta.completions if c.finish_reason]
                self.record_finished(stream, reasons[-1] if reasons else "stop")

    def record_progress(self, stream: RequestStream, delta: RequestDelta, now: float) -> None:
        if delta.prompt_token_ids is not None:
            stream.first_scheduled_time = delta.first_scheduled_time
        num_new_tokens = 0
        for change in delta.completions:
            num_new_tokens += len(change.token_ids)
            stream.num_tokens_per_sample[change.index] = stream.num_tokens_per_sample.get(change.index, 0) + len(
                change.token_ids
            )
        ttft = itl = None
        num_prompt_tokens = num_cached_tokens = 0
        if stream.first_token_time is None:
            stream.first_token_time = now
            ttft = now - stream.arrival_time
            num_prompt_tokens = len(delta.prompt_token_ids or stream.prompt_token_ids)
            num_cached_tokens = delta.num_cached_tokens
        elif num_new_tokens:
            itl = now - stream.last_token_time
        if num_new_tokens:
            stream.last_token_time = now
        stream.num_generation_tokens += num_new_tokens
        if self.stats_listener is not None:
            self.stats_listener.record_tokens(
                TokenStats(num_prompt_tokens, num_cached_tokens, num_new_tokens, ttft, itl)
            )

    def record_finished(self, stream: RequestStream, finish_reason: str) -> None:
        if self.stats_listener is None:
            return
        now = time.monotonic()
        scheduled = stream.first_scheduled_time or now
        first_token = stream.first_token_time or now
        last_token = stream.last_token_time or now
        self.stats_listener.record_finished(
            FinishedRequestStats(
                finish_reason=finish_reason,
                num_prompt_tokens=len(stream.prompt_token_ids),
                num_generation_tokens=stream.num_generation_tokens,
                max_num_generation_tokens=max(stream.num_tokens_per_sample.values(), default=0),
                e2e_latency=max(0.0, last_token - stream.arrival_time),
                queue_time=max(0.0, scheduled - stream.arrival_time),
                prefill_time=max(0.0, first_token - scheduled),
                decode_time=max(0.0, last_token - first_token),
            )
        )

    def fail_all(self, error: EngineDeadError) -> None:
        self.dead = error
        for stream in self.streams.values():
            stream.end(error)
        self.streams.clear()

    # --- life cycle -------------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.dead is None and self.core.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the engine core and release its resources. Safe to call twice."""
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.shutdown)
        self.dead = self.dead or EngineDeadError("the engine was shut down")
        for stream in self.streams.values():
            stream.end()
        self.streams.clear()
        if self.core.is_alive():
            with contextlib.suppress(EngineDeadError):
                self.send(Shutdown())
            self.core.join(timeout)
            if isinstance(self.core, multiprocessing.process.BaseProcess) and self.core.is_alive():
                self.core.kill()
                self.core.join(timeout)
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.join(timeout)  # it closes the output socket
        else:
            self.output_socket.close(linger=0)
        self.input_socket.close(linger=0)
        if not self.core.is_alive():  # a core thread stuck in a step still holds its sockets: leave the context
            self.context.term()
        shutil.rmtree(self.work_dir, ignore_errors=True)
