"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, sampling_params) and LLM(...).chat(messages)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.input_processor import check_conversation
from pagedllm.outputs import RequestOutput
from pagedllm.sampling.params import SamplingParams
from pagedllm.trace.step_record import StepRecord

Prompt = str | dict


class LLM:
    """An LLM for offline batched inference.

    `model` is a Hugging Face model directory or a .gguf file; None loads the embedded SmolLM2-135M-Instruct.
    Every keyword is an EngineConfig field; an unknown one is a TypeError.

    tensor_parallel_size=N > 1 starts N - 1 more processes (one per rank), or joins the ranks torchrun launched; in
    torchrun's processes of ranks other than 0, LLM(...) serves rank 0 and then exits the process. shutdown(), a
    `with` block, garbage collection and interpreter exit end them.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self.request_counter = itertools.count()  # generate()'s request ids

    def shutdown(self) -> None:
        """End the engine's other processes and free its memory; the LLM runs nothing afterwards. Idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the settings the model's generation_config sets (temperature, top_p, top_k, min_p,
        repetition_penalty), SamplingParams' defaults elsewhere: what generate() and chat() use when given None, as
        vLLM's generation_config="auto" does."""
        return SamplingParams(**self.llm_engine.model_sampling_defaults)

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes so the next run computes everything again (benchmarks use this)."""
        self.llm_engine.block_manager.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order. Bad input raises before anything runs.

        generate() owns the engine while it runs: if requests added with `llm_engine.add_request()` are still
        unfinished it raises ValueError and queues nothing (step them to completion or abort them first), so no
        one else's outputs are consumed. Its own request ids ("generate-N") never collide with user ids.
        """
        is_list = isinstance(prompts, list | tuple)
        prompt_list = list(prompts) if is_list else [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = per_prompt_params(sampling_params, len(prompt_list))
        engine = self.llm_engine
        if engine.requests:
            pending = sorted(engine.requests)
            raise ValueError(
                f"generate() cannot run while {len(pending)} request(s) added with add_request() are unfinished "
                f"(e.g. {pending[0]!r}): step() until they finish, or abort_request() them, first"
            )
        # A prefix of our own plus a counter; add_request still refuses an id in use.
        request_ids = [f"generate-{next(self.request_counter)}" for _ in prompt_list]
        added = []
        try:
            for index, (request_id, prompt, params) in enumerate(zip(request_ids, prompt_list, params_list)):
                try:
                    engine.add_request(request_id, prompt, params, stream=False)
                except (ValueError, TypeError) as error:
                    if is_list:  # say which prompt of the list is wrong
                        error.args = (f"prompts[{index}]: {error}",)
                    raise
                added.append(request_id)
            return self.run_to_completion(request_ids, use_tqdm, is_list)
        except BaseException:
            for request_id in added:  # a failure (bad prompt, Ctrl-C) leaves nothing behind in the engine
                engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role": str, "content": str}) or a list of conversations."""
        if not isinstance(messages, list | tuple):
            raise TypeError(
                "messages must be one conversation (a list of {'role': str, 'content': str} dicts) or a list of "
                f"conversations, got {type(messages).__name__}"
            )
        several = bool(messages) and all(isinstance(conversation, list | tuple) for conversation in messages)
        conversations = list(messages) if several else [messages]
        for index, conversation in enumerate(conversations):
            check_conversation(conversation, f"messages[{index}]" if several else "messages")
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(
        self, conversation: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> dict:
        """One conversation rendered by the model's chat template, as {"prompt_token_ids": [...]}."""
        import jinja2  # transformers' chat templates need it; it is not a dependency of ours otherwise

        check_conversation(conversation, "conversation")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, but the LLM was built with skip_tokenizer_init=True")
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate()")
        try:
            token_ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True
            )
        except jinja2.TemplateError as error:  # e.g. the template's own raise_exception("roles must alternate")
            raise ValueError(f"the chat template rejected this conversation: {error}") from None
        if hasattr(token_ids, "keys"):  # transformers 5 returns a BatchEncoding
            token_ids = token_ids["input_ids"]
        return {"prompt_token_ids": list(token_ids)}

    def run_to_completion(self, request_ids: list[str], use_tqdm: bool, is_list: bool) -> list[RequestOutput]:
        """Step until every request finished. A request whose constraint cannot be compiled (found while the others
        run) raises its ValueError, naming its prompt in a list; generate() then aborts the others."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        rates = StepRates()
        if use_tqdm:
            engine.add_step_listener(rates.add)
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                for rejection in engine.take_rejected():
                    prefix = f"prompts[{request_ids.index(rejection.request_id)}]: " if is_list else ""
                    raise ValueError(f"{prefix}{rejection.error}")
                progress.set_postfix_str(rates.describe(), refresh=False)
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        finally:
            if use_tqdm:
                engine.remove_step_listener(rates.add)
            progress.close()
            engine.write_trace()
        return [finished[request_id] for request_id in request_ids]


class StepRates:
    """Prefill and decode tokens per second of the latest steps, from the engine's step records: a step lasts
    from the previous step's tokens reaching the host to its own (the device's pace, also when steps overlap)."""

    def __init__(self):
        self.previous_resolved_at: float | None = None
        self.prefill = self.decode = 0.0

    def add(self, record: StepRecord) -> None:
        start = self.previous_resolved_at if self.previous_resolved_at is not None else record.scheduled_at
        elapsed = max(record.resolved_at - start, 1e-9)
        self.previous_resolved_at = record.resolved_at
        if record.num_decode_tokens:
            self.decode = record.num_decode_tokens / elapsed
        if record.num_prefill_tokens:
            self.prefill = record.num_prefill_tokens / elapsed

    def describe(self) -> str:
        return f"prefill {self.prefill:.0f} tok/s, decode {self.decode:.0f} tok/s"


def per_prompt_params(
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if not isinstance(sampling_params, list | tuple):
        raise TypeError(
            "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
            f"got {type(sampling_params).__name__} {sampling_params!r:.80}"
        )
    for index, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts; give one, or one per prompt"
        )
    return list(sampling_params)
