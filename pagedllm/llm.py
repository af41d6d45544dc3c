"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, sampling_params) and LLM(...).chat(messages)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.step_pipeline import StepRecord
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """An LLM for offline batched inference.

    `model` is a Hugging Face model directory or a .gguf file; None loads the embedded SmolLM2-135M-Instruct.
    Every keyword is an EngineConfig field; an unknown one is a TypeError.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes so the next run computes everything again (benchmarks use this)."""
        self.llm_engine.block_manager.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order. Bad input raises before anything runs."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = per_prompt_params(sampling_params, len(prompt_list))
        engine = self.llm_engine
        request_ids = [engine.next_request_id() for _ in prompt_list]
        added = []
        try:
            for request_id, prompt, params in zip(request_ids, prompt_list, params_list):
                engine.add_request(request_id, prompt, params, stream=False)
                added.append(request_id)
            return self.run_to_completion(request_ids, use_tqdm)
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
        """Answer one conversation (a list of {"role", "content"}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(
        self, conversation: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> dict:
        """One conversation rendered by the model's chat template, as {"prompt_token_ids": [...]}."""
        tokenizer = self.get_tokenizer()
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate()")
        token_ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True
        )
        if hasattr(token_ids, "keys"):  # transformers 5 returns a BatchEncoding
            token_ids = token_ids["input_ids"]
        return {"prompt_token_ids": list(token_ids)}

    def run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        rates = StepRates()
        if use_tqdm:
            engine.add_step_listener(rates.add)
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
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
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts; give one, or one per prompt")
    return params
