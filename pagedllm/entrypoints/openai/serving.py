"""The OpenAI endpoints' work: prompts to engine requests, engine outputs to completion and chat responses, whole
or as server-sent events (one chunk per choice carries its finish_reason; usage last when asked; then [DONE])."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagedllm.entrypoints.openai.async_engine import AsyncLLM, EngineDeadError, RequestStream
from pagedllm.entrypoints.openai.chat_output import ChatOutput, is_empty
from pagedllm.entrypoints.openai.chat_plan import ServerParsers, plan_chat
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    InvalidRequestError,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    PromptTokensDetails,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagedllm.entrypoints.openai.tools import template_messages
from pagedllm.outputs import RequestOutput
from pagedllm.sampling.params import SamplingParams

# apply_chat_template's own arguments, which the server sets (and which chat_template_kwargs must not repeat); of
# them, those a request sends as fields of its own.
TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
TEMPLATE_ARGUMENTS -= {"self", "kwargs"}
TEMPLATE_REQUEST_FIELDS = {"add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template"}
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MIN_LOGPROB = -9999.0  # JSON has no -inf


NORMALIZER_MARGIN = 4  # a normalizer may fold characters into fewer (NFC composes "e" + U+0301 into one)


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve: answered as a 404."""


@dataclass(slots=True)
class PromptInput:
    text: str | None
    token_ids: list[int]


@dataclass(slots=True)
class ChoiceProgress:
    """What one streamed choice has sent so far."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False


def aborted_choices(progress: dict[int, ChoiceProgress], num_choices: int) -> list[int]:
    """The choices a stream that ended had not finished: their requests were aborted (shutdown, or the engine's
    abort), and each still owes the client a chunk with finish_reason "abort"."""
    return [index for index in range(num_choices) if index not in progress or not progress[index].finished]


def sse(model: OpenAIBaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they arrive."""
    if len(streams) == 1:
        async with aclosing(streams[0].__aiter__()) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:
            queue.put_nowait((index, error))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, model_root: str, parsers: ServerParsers | None = None):
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_root = model_root
        self.tokenizer = llm.tokenizer
        self.parsers = parsers or ServerParsers()  # --tool-call-parser, --reasoning-parser
        # The most characters one token can stand for, times a margin for normalizers that fold several characters
        # into one: a text longer than this x max_model_len cannot fit, whatever it says (0: no tokenizer, no bound).
        longest = max(map(len, self.tokenizer.get_vocab()), default=0) if self.tokenizer is not None else 0
        self.chars_per_token_bound = NORMALIZER_MARGIN * longest

    # --- shared -----------------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves `{self.served_model_name}`"
            )

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card(self.served_model_name)])

    def model_card(self, model: str) -> ModelCard:
        """GET /v1/models/{model}: this server's one model, or a 404 for any other name."""
        self.check_model(model)
        return ModelCard(id=self.served_model_name, root=self.model_root, max_model_len=self.llm.max_model_len)

    def refuse_unread_if_too_long(self, num_chars: int, param: str) -> None:
        """A text of num_chars characters has at least num_chars / chars_per_token_bound tokens: when even that
        exceeds max_model_len it is refused before it is tokenized (megabytes of text would hold the tokenizer, and
        the GIL with it, for seconds while the other streams wait)."""
        limit, bound = self.llm.max_model_len, self.chars_per_token_bound
        if bound and num_chars > bound * limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt's {num_chars} characters "
                f"are at least {num_chars // bound} tokens. Please shorten the prompt.",
                param,
            )

    def check_length(self, prompt: PromptInput, max_tokens: int | None) -> int:
        """The request's max_tokens (None: all the room left); 400 when prompt + max_tokens exceed max_model_len."""
        limit = self.llm.max_model_len
        num_prompt_tokens = len(prompt.token_ids)
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                "tokens (and at least one token must be generated). Please shorten the prompt.",
                "prompt",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                "max_tokens",
            )
        return max_tokens

    async def start_requests(
        self,
        request: SamplingRequest,
        prompts: list[PromptInput],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        request_id: str,
        adjust: Callable[[SamplingParams, list[int]], None] | None = None,
    ) -> list[RequestStream]:
        """Validate every prompt first, then queue them all; nothing stays queued if one is refused. adjust(params,
        prompt token ids) may change each prompt's params first (a chat request's ChatPlan.apply)."""
        for value, name in ((logprobs, "logprobs"), (prompt_logprobs, "prompt_logprobs")):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
        params = [
            request.to_sampling_params(self.check_length(prompt, max_tokens), logprobs, prompt_logprobs)
            for prompt in prompts
        ]
        if adjust is not None:
            for prompt, prompt_params in zip(prompts, params):
                adjust(prompt_params, prompt.token_ids)
        streams: list[RequestStream] = []
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                engine_prompt = {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text}
                streams.append(await self.llm.add_request(engine_prompt, prompt_params, f"{request_id}-{index}"))
        except BaseException as error:
            for stream in streams:
                self.llm.abort(stream.request_id)
            if isinstance(error, ValueError | TypeError) and not isinstance(error, InvalidRequestError):
                raise InvalidRequestError(str(error), request.field_named_in(str(error))) from None
            raise
        return streams

    def decode_token(self, token_id: int, logprob) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def usage(self, prompts: list[PromptInput], num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
        """OpenAI's usage; num_cached_tokens: the prompt tokens found in the prefix cache (RequestOutput's)."""
        num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
        )

    # --- /v1/completions --------------------------------------------------------------------------------------

    def completion_prompts(self, prompt: str | list) -> list[PromptInput]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(token, int) for token in prompt):
            prompt = [prompt]
        for item in prompt:
            if isinstance(item, str):
                self.refuse_unread_if_too_long(len(item), "prompt")
        inputs = []
        for item in prompt:
            try:
                text, token_ids = self.llm.tokenize(item if isinstance(item, str) else {"prompt_token_ids": item})
            except (ValueError, TypeError) as error:
                raise InvalidRequestError(str(error), "prompt") from None
            inputs.append(PromptInput(text, token_ids))
        return inputs

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        request.check_supported()
        if request.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        prompts = await asyncio.to_thread(self.completion_prompts, request.prompt)  # seconds for megabytes of text
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start_requests(
            request, prompts, request.max_tokens, request.logprobs, prompt_logprobs, request_id
        )
        if request.stream:
            return self.completion_stream(request, prompts, streams, request_id)
        return await self.completion_full(request, prompts, streams, request_id)

    def echo_text(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    def completion_logprobs(self, token_ids: list[int], positions: list, num_top: int, offset: int):
        """OpenAI's legacy logprobs: per token its text, logprob, text offset and the top alternatives."""
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, positions):
            chosen = entry.get(token_id) if entry else None
            token = self.decode_token(token_id, chosen)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first prompt token has no logprob
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
            top = {
                self.decode_token(other_id, lp): max(lp.logprob, MIN_LOGPROB)
                for other_id, lp in entry.items()
                if other_id == token_id or lp.rank is None or lp.rank <= num_top
            }
            result.top_logprobs.append(top)
        return result

    async def completion_full(
        self, request: CompletionRequest, prompts: list[PromptInput], streams: list[RequestStream], request_id: str
    ) -> CompletionResponse:
        finals = await final_outputs(streams)
        choices, num_completion_tokens = [], 0
        for prompt_index, (prompt, output) in enumerate(zip(prompts, finals)):
            for completion in output.outputs:
                index = prompt_index * request.n + completion.index
                # A finished choice as one chunk: everything it has, from an empty progress.
                choices.append(
                    self.completion_chunk_choice(request, prompt, output, completion, index, ChoiceProgress())
                )
                num_completion_tokens += len(completion.token_ids)
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=self.usage(prompts, num_completion_tokens, sum(output.num_cached_tokens for output in finals)),
        )

    async def completion_stream(
        self, request: CompletionRequest, prompts: list[PromptInput], streams: list[RequestStream], request_id: str
    ) -> AsyncIterator[str]:
        created = int(time.time())
        progress: dict[int, ChoiceProgress] = {}
        num_cached_tokens: dict[int, int] = {}  # per prompt
        try:
            async with aclosing(merge_streams(streams)) as outputs:
                async for prompt_index, output in outputs:
                    num_cached_tokens[prompt_index] = output.num_cached_tokens
                    for completion in output.outputs:
                        index = prompt_index * request.n + completion.index
                        choice = progress.setdefault(index, ChoiceProgress())
                        chunk_choice = self.completion_chunk_choice(
                            request, prompts[prompt_index], output, completion, index, choice
                        )
                        if chunk_choice is not None:
                            response = CompletionResponse(
                                id=request_id, created=created, model=self.served_model_name, choices=[chunk_choice]
                            )
                            yield sse(response)
            for index in aborted_choices(progress, len(prompts) * request.n):
                choice = CompletionChoice(index=index, text="", finish_reason="abort")
                yield sse(
                    CompletionResponse(id=request_id, created=created, model=self.served_model_name, choices=[choice])
                )
            if request.stream_options is not None and request.stream_options.include_usage:
                num_tokens = sum(choice.num_tokens for choice in progress.values())
                usage = self.usage(prompts, num_tokens, sum(num_cached_tokens.values()))
                yield sse(
                    CompletionResponse(
                        id=request_id, created=created, model=self.served_model_name, choices=[], usage=usage
                    )
                )
        except Exception as error:  # the engine stopped: tell the client in the stream, then end it
            yield f"data: {stream_error(error)}\n\n"
        finally:
            for stream in streams:
                self.llm.abort(stream.request_id)  # the client left early: free the blocks now (no-op if finished)
        yield "data: [DONE]\n\n"

    def completion_chunk_choice(
        self,
        request: CompletionRequest,
        prompt: PromptInput,
        output: RequestOutput,
        completion,
        index: int,
        choice: ChoiceProgress,
    ) -> CompletionChoice | None:
        """The text and tokens a choice gained since its last chunk (all of it from a fresh ChoiceProgress); None
        when there is nothing to send."""
        if choice.finished:
            return None
        text = completion.text[choice.text_len :]
        token_ids = list(completion.token_ids[choice.num_tokens :])
        if not text and not token_ids and completion.finish_reason is None:
            return None
        positions = list((completion.logprobs or [])[choice.num_tokens :]) if request.logprobs is not None else []
        offset = choice.text_len
        if request.echo and not choice.started:
            echo = self.echo_text(prompt)
            text = echo + text
            if request.logprobs is not None:
                token_ids = prompt.token_ids + token_ids
                positions = list(output.prompt_logprobs or []) + positions
        elif request.echo:
            offset += len(self.echo_text(prompt))
        logprobs = None
        if request.logprobs is not None:
            logprobs = self.completion_logprobs(token_ids, positions, request.logprobs, offset)
        choice.started = True
        choice.text_len = len(completion.text)
        choice.num_tokens = len(completion.token_ids)
        choice.finished = completion.finish_reason is not None
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    # --- /v1/chat/completions ---------------------------------------------------------------------------------

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> PromptInput:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        conversation = template_messages(messages)
        try:
            token_ids = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
                **(template_kwargs or {}),
            )
        except Exception as error:  # the template rejected the conversation (jinja raise_exception, bad role...)
            raise InvalidRequestError(f"the chat template failed on these messages: {error}", "messages") from None
        if hasattr(token_ids, "keys"):  # transformers 5 returns a BatchEncoding
            token_ids = token_ids["input_ids"]
        return PromptInput(None, list(token_ids))

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt, streams, chat_output = await self.start_chat(request, request_id)
        if request.stream:
            return self.chat_stream(request, prompt, streams[0], request_id, chat_output)
        output = (await final_outputs(streams))[0]
        choices = []
        for completion in output.outputs:
            message = chat_output.message(completion.text)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self.chat_logprobs(request, completion, completion.token_ids, completion.logprobs),
                    finish_reason=chat_finish_reason(completion.finish_reason, bool(message.tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        num_completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=self.usage([prompt], num_completion_tokens, output.num_cached_tokens),
        )

    async def start_chat(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[PromptInput, list[RequestStream], ChatOutput]:
        """A chat request checked, rendered and queued (also /v1/responses' path): its prompt, its stream, and how
        its replies read."""
        self.check_model(request.model)
        request.check_supported()
        plan = plan_chat(request, self.parsers)
        check_template_kwargs(request.chat_template_kwargs or {})  # before the tools join them
        self.refuse_unread_if_too_long(sum(map(text_chars, request.messages)), "messages")
        prompt = await asyncio.to_thread(  # the template and the tokenizer: seconds for megabytes of text
            self.chat_prompt,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            plan.template_kwargs(request.chat_template_kwargs),
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        streams = await self.start_requests(request, [prompt], max_tokens, logprobs, None, request_id, plan.apply)
        return prompt, streams, plan.output(prompt.token_ids)

    def ends_by_token(self, request: SamplingRequest, completion) -> bool:
        """The completion ended on an EOS or stop token whose text it leaves out (the engine's rule)."""
        if completion.finish_reason != "stop" or not completion.token_ids or request.include_stop_str_in_output:
            return False
        last, stop_reason = completion.token_ids[-1], completion.stop_reason
        if stop_reason is None:  # EOS, or a grammar that ended on its last (text) token
            return last in self.llm.eos_token_ids
        return type(stop_reason) is int and stop_reason == last

    def chat_logprobs(
        self, request: ChatCompletionRequest, completion, token_ids: list[int], positions
    ) -> ChatLogprobs | None:
        """Chat logprobs of token_ids (the completion's tokens since the last chunk), aligned with the message text:
        the end token that the text leaves out (<|im_end|>, EOS, a stop token) has none."""
        if not request.logprobs:
            return None
        if token_ids and self.ends_by_token(request, completion):
            token_ids = token_ids[:-1]
        content = []
        num_top = request.top_logprobs or 0
        for token_id, entry in zip(token_ids, positions or []):
            chosen = entry[token_id]
            top = sorted(
                ((other_id, lp) for other_id, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                key=lambda item: item[1].rank,
            )
            content.append(
                TokenLogprob(
                    **self.top_logprob(token_id, chosen).model_dump(),
                    top_logprobs=[self.top_logprob(other_id, lp) for other_id, lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def top_logprob(self, token_id: int, logprob) -> TopLogprob:
        token = self.decode_token(token_id, logprob)
        return TopLogprob(token=token, logprob=max(logprob.logprob, MIN_LOGPROB), bytes=list(token.encode("utf-8")))

    async def chat_stream(
        self,
        request: ChatCompletionRequest,
        prompt: PromptInput,
        stream: RequestStream,
        request_id: str,
        chat_output: ChatOutput,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.served_model_name, choices=choices, usage=usage
                )
            )

        progress = {index: ChoiceProgress() for index in range(request.n)}
        readers = {index: chat_output.stream() for index in progress}
        num_cached_tokens = 0
        try:
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in progress])
            async with aclosing(merge_streams([stream])) as outputs:
                async for _, output in outputs:
                    num_cached_tokens = output.num_cached_tokens
                    for completion in output.outputs:
                        choice = progress[completion.index]
                        text = completion.text[choice.text_len :]
                        token_ids = list(completion.token_ids[choice.num_tokens :])
                        if choice.finished or (not text and not token_ids and completion.finish_reason is None):
                            continue
                        positions = (completion.logprobs or [])[choice.num_tokens :] if request.logprobs else None
                        choice.text_len = len(completion.text)
                        choice.num_tokens = len(completion.token_ids)
                        choice.finished = completion.finish_reason is not None
                        reader = readers[completion.index]
                        message = reader.step(completion.text, choice.finished)
                        if is_empty(message) and not positions and not choice.finished:
                            continue  # the text so far may still turn out to be a tool call or thinking
                        delta = ChatChunkChoice(
                            index=completion.index,
                            delta=message,
                            logprobs=self.chat_logprobs(request, completion, token_ids, positions),
                            finish_reason=chat_finish_reason(completion.finish_reason, reader.made_tool_calls),
                            stop_reason=completion.stop_reason,
                        )
                        yield chunk([delta])
            for index in aborted_choices(progress, request.n):
                yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason="abort")])
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = self.usage([prompt], sum(choice.num_tokens for choice in progress.values()), num_cached_tokens)
                yield chunk([], usage)
        except Exception as error:
            yield f"data: {stream_error(error)}\n\n"
        finally:
            self.llm.abort(stream.request_id)
        yield "data: [DONE]\n\n"

    # --- /tokenize, /detokenize -------------------------------------------------------------------------------

    async def tokenize(self, request) -> str:
        """/tokenize's JSON body. Tokenizing and writing out the ids run in a worker thread (seconds for megabytes of
        text), so other streams go on meanwhile."""
        self.check_model(request.model)
        if self.tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer (skip_tokenizer_init)")
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
        return await asyncio.to_thread(self.tokenize_to_json, request)

    def tokenize_to_json(self, request) -> str:
        if request.messages is not None:
            token_ids = self.chat_prompt(request.messages, request.add_generation_prompt).token_ids
        else:
            token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return json.dumps({"count": len(token_ids), "max_model_len": self.llm.max_model_len, "tokens": token_ids})

    def tokenizer_info(self) -> dict:
        """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info; lm-eval's remote tokenizer)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer (skip_tokenizer_init)")
        tokenizer = self.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": self.llm.max_model_len,
        }

    async def detokenize(self, request) -> dict:
        self.check_model(request.model)
        if self.tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer (skip_tokenizer_init)")
        vocab_size = self.llm.vocab_size
        bad = [token for token in request.tokens if not 0 <= token < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"tokens holds ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}", "tokens"
            )
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, request.tokens)}


def check_template_kwargs(template_kwargs: dict) -> None:
    """chat_template_kwargs holds the chat template's own variables (enable_thinking, ...); a key that is an argument
    of apply_chat_template itself, which the server sets, is a 400 saying what to send instead."""
    for key in template_kwargs:
        if key in TEMPLATE_REQUEST_FIELDS:
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}: {key} is a field of the request itself; send it there, not in "
                "chat_template_kwargs (which holds the chat template's own variables, e.g. enable_thinking)",
                "chat_template_kwargs",
            )
        if key in TEMPLATE_ARGUMENTS:
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}: the server sets {key} itself when it renders the chat template; "
                "chat_template_kwargs holds only the template's own variables (e.g. enable_thinking)",
                "chat_template_kwargs",
            )


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's last (finished) output; cancelling this aborts every request."""

    async def last(stream: RequestStream) -> RequestOutput:
        output = None
        async with aclosing(stream.__aiter__()) as outputs:
            async for item in outputs:
                output = item
        if output is None or not output.finished:
            raise EngineDeadError("the request was aborted: the server is shutting down")
        return output

    tasks = [asyncio.ensure_future(last(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def chat_finish_reason(finish_reason: str | None, made_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself after calling tools."""
    return "tool_calls" if made_tool_calls and finish_reason == "stop" else finish_reason


def stream_error(error: Exception) -> str:
    return ErrorResponse(error=ErrorInfo(message=str(error), type="server_error", code=500)).model_dump_json()


def text_chars(message) -> int:
    """The characters of a chat message's text (its content, or its content parts' text)."""
    content = message.content
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text or "") for part in content or ())
