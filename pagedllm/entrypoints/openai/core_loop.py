"""The engine core's loop: it owns one LLMEngine, takes requests and aborts from a zmq socket, steps the engine,
and sends each step's new tokens and text (deltas) plus engine statistics back, encoded with msgspec.

It runs in its own process (AsyncLLM's default, as vLLM V1 does) or in a thread of the caller's process.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai import serve_extra_missing

try:
    import msgspec
    import zmq
except ModuleNotFoundError as error:
    raise serve_extra_missing("AsyncLLM's core loop", error) from None

from pagedllm.config import EngineConfig
from pagedllm.sampling.params import SamplingParams

# --- messages, frontend -> core ---------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequest | AbortRequests | Shutdown

# --- messages, core -> frontend ---------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    tokenizer_dir: str | None  # the engine's tokenizer, saved for the frontend (None with skip_tokenizer_init)
    eos_token_ids: list[int]  # the tokens that end an output as EOS (the frontend tells them from text)


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error_type: str  # "ValueError", "TypeError", "OSError" ... of the exception the engine raised
    message: str


# One logprob entry as (token_id, logprob, rank, decoded_token); a position is a list of them.
EncodedLogprobs = list[list[tuple[int, float, int | None, str | None]]]


class CompletionDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    index: int
    text: str  # text added since the last delta of this completion
    token_ids: list[int]  # tokens added since the last delta
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: EncodedLogprobs | None = None  # entries added since the last delta


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of the step that first admitted it; first delta
    prompt_token_ids: list[int] | None = None  # first delta only
    prompt_logprobs: EncodedLogprobs | None = None  # first delta only (None stands for the first prompt token)


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # held blocks / all blocks
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative prompt tokens found there
    # Speculative decoding, cumulative (0 without it): sequences that verified drafts in a step, drafts, accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class Rejected(msgspec.Struct, array_like=True):
    request_id: str
    error_type: str
    message: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    stats: EngineStats
    deltas: list[RequestDelta] = []
    accepted: list[str] = []
    rejected: list[Rejected] = []


CoreOutput = Ready | StartupFailed | StepOutputs


def encode_logprobs(positions: list | None) -> EncodedLogprobs | None:
    """[{token_id: Logprob}] -> plain tuples; a None position (the first prompt token) becomes []."""
    if positions is None:
        return None
    return [
        [(token_id, lp.logprob, lp.rank, lp.decoded_token) for token_id, lp in (entry or {}).items()]
        for entry in positions
    ]


# --- the core loop --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SentProgress:
    """How much of each completion of one request was already sent, so each step sends only what is new."""

    text_len: dict[int, int] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    first_scheduled_time: float | None = None
    sent_any: bool = False


class CoreLoop:
    """Serves one LLMEngine to a frontend over two sockets. In vLLM's terms this is EngineCoreProc, the busy loop
    around the sockets; what vLLM calls EngineCore (schedule, execute, update, one step at a time) is LLMEngine."""

    def __init__(self, engine, input_socket: zmq.Socket, output_socket: zmq.Socket):
        self.engine = engine
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.progress: dict[str, SentProgress] = {}
        self.unscheduled: set[str] = set()  # accepted, not yet seen in scheduler.running
        # Structured requests are accepted only once their grammar compiled, so that a constraint the library refuses
        # is still an HTTP 400: the frontend starts no response before a request is accepted.
        self.compiling: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def run(self, parent_alive=lambda: True) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished_requests()
            if not busy and not poller.poll(timeout=1000):  # idle: sleep on the socket
                if not parent_alive():
                    return
                continue
            accepted, rejected, received = [], [], False
            while self.input_socket.poll(0):
                message = self.decoder.decode(self.input_socket.recv(copy=False))
                received = True
                if isinstance(message, Shutdown):
                    self.abort(list(self.progress))
                    return
                if isinstance(message, AbortRequests):
                    self.abort(message.request_ids)
                else:
                    self.add(message, accepted, rejected)
            if received:  # acknowledge at once: the frontend answers HTTP errors before the next step ends
                self.send(StepOutputs(self.stats(), accepted=accepted, rejected=rejected))
            if self.engine.has_unfinished_requests():
                self.step()

    def add(self, message: AddRequest, accepted: list[str], rejected: list[Rejected]) -> None:
        prompt = {"prompt_token_ids": message.prompt_token_ids}
        if message.prompt is not None:
            prompt["prompt"] = message.prompt
        try:
            self.engine.add_request(message.request_id, prompt, message.sampling_params, stream=True)
        except (ValueError, TypeError) as error:
            rejected.append(Rejected(message.request_id, type(error).__name__, str(error)))
            return
        self.progress[message.request_id] = SentProgress()
        self.unscheduled.add(message.request_id)
        if self.engine.waits_for_grammar(message.request_id):
            self.compiling.add(message.request_id)
        else:
            accepted.append(message.request_id)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.progress.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)  # frees its KV blocks now
                self.unscheduled.discard(request_id)
                self.compiling.discard(request_id)

    def step(self) -> None:
        step_start = time.monotonic()
        outputs = self.engine.step()
        if self.unscheduled:
            for seq in self.engine.scheduler.running:
                if seq.request_id in self.unscheduled:
                    self.unscheduled.discard(seq.request_id)
                    self.progress[seq.request_id].first_scheduled_time = step_start
        accepted, rejected = self.compiled() if self.compiling else ([], [])
        deltas = [self.delta(output, step_start) for output in outputs if output.request_id in self.progress]
        self.send(StepOutputs(self.stats(), deltas=deltas, accepted=accepted, rejected=rejected))

    def compiled(self) -> tuple[list[str], list[Rejected]]:
        """The structured requests whose grammar compiled this step (accepted: the frontend applies acceptances before
        the deltas of the same message) and those whose constraint was refused (gone from the engine)."""
        rejected = []
        for rejection in self.engine.take_rejected():
            if self.progress.pop(rejection.request_id, None) is not None:
                self.unscheduled.discard(rejection.request_id)
                self.compiling.discard(rejection.request_id)
                rejected.append(Rejected(rejection.request_id, "ValueError", str(rejection.error)))
        accepted = [request_id for request_id in self.compiling if not self.engine.waits_for_grammar(request_id)]
        self.compiling.difference_update(accepted)
        return accepted, rejected

    def delta(self, output, step_start: float) -> RequestDelta:
        progress = self.progress[output.request_id]
        completions = []
        for completion in output.outputs:
            index = completion.index
            text_len = progress.text_len.get(index, 0)
            num_tokens = progress.num_tokens.get(index, 0)
            logprobs = completion.logprobs
            num_logprobs = progress.num_logprobs.get(index, 0)
            if len(completion.token_ids) == num_tokens and completion.finish_reason is None:
                continue  # this completion made no progress this step (n > 1)
            completions.append(
                CompletionDelta(
                    index=index,
                    text=completion.text[text_len:],
                    token_ids=list(completion.token_ids[num_tokens:]),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    cumulative_logprob=completion.cumulative_logprob,
                    logprobs=encode_logprobs(logprobs[num_logprobs:]) if logprobs else None,
                )
            )
            progress.text_len[index] = len(completion.text)
            progress.num_tokens[index] = len(completion.token_ids)
            progress.num_logprobs[index] = len(logprobs) if logprobs else 0
        delta = RequestDelta(output.request_id, completions, output.finished, output.num_cached_tokens)
        if not progress.sent_any:
            progress.sent_any = True
            if output.request_id in self.unscheduled:  # admitted and finished within one step
                self.unscheduled.discard(output.request_id)
                progress.first_scheduled_time = step_start
            delta.first_scheduled_time = progress.first_scheduled_time
            delta.prompt_token_ids = list(output.prompt_token_ids)
            delta.prompt_logprobs = encode_logprobs(output.prompt_logprobs)
            self.prefix_cache_queries += len(output.prompt_token_ids)
            self.prefix_cache_hits += output.num_cached_tokens
        if output.finished:
            del self.progress[output.request_id]
        return delta

    def stats(self) -> EngineStats:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        speculation = self.engine.spec_decode_stats
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_decode_num_drafts=speculation.num_drafts if speculation else 0,
            spec_decode_num_draft_tokens=speculation.num_draft_tokens if speculation else 0,
            spec_decode_num_accepted_tokens=speculation.num_accepted_tokens if speculation else 0,
        )

    def send(self, message: StepOutputs) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)


def ready_message(engine, tokenizer_dir: str) -> Ready:
    saved_dir = None
    if engine.tokenizer is not None:
        engine.tokenizer.save_pretrained(tokenizer_dir)
        saved_dir = tokenizer_dir
    return Ready(
        engine.max_model_len,
        engine.spec.vocab_size,
        engine.block_manager.num_blocks,
        saved_dir,
        sorted(engine.eos_token_ids),
    )


def run_core_loop(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    tokenizer_dir: str,
    num_threads: int | None = None,
    context: zmq.Context | None = None,
) -> None:
    """Build the engine and serve the frontend until Shutdown (or, in a child process, until the parent dies).
    A startup error is sent as StartupFailed instead of raised, so the frontend can report it."""
    in_child = context is None
    context = context or zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # the engine never waits for a slow frontend
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        from pagedllm.engine.engine import LLMEngine

        engine = LLMEngine(config)
        output_socket.send(encoder.encode(ready_message(engine, tokenizer_dir)))
    except Exception as error:  # reported to the frontend, which raises it there
        output_socket.send(encoder.encode(StartupFailed(type(error).__name__, str(error))))
        engine = None
    try:
        if engine is not None:
            parent = multiprocessing.parent_process() if in_child else None
            parent_alive = parent.is_alive if parent is not None else lambda: True
            CoreLoop(engine, input_socket, output_socket).run(parent_alive)
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=1000)
        if in_child:
            context.term()


def core_process_main(*args) -> None:
    """Entry point of the engine core's process: Ctrl-C goes to the frontend, which shuts the core down."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_core_loop(*args)
