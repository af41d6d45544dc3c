"""SamplingParams: how one request picks its tokens and when it stops, with vLLM's names, defaults and meanings.

Every field is checked when the object is built (ValueError for a bad value, TypeError for a wrong type); the
checks that need the model's vocabulary size run in validate_for_model(), which the engine calls at add_request.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.structured_output.params import StructuredOutputsParams

# Below this temperature a row is sampled greedily, as vLLM does: logits / T would overflow float32 otherwise.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1
# torch.Generator.manual_seed takes any int in this range (a negative seed wraps to 2**64 + seed).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt; sample i draws with seed + i (vLLM's rule), its prompt computed once
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of the token in the output
    repetition_penalty: float = 1.0  # > 0: logits of prompt or output tokens divided (if > 0) or multiplied by it
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy
    top_p: float = 1.0  # in (0, 1]: keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # 0 or -1: off; k >= 1 keeps the k most likely tokens
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely one
    # The request's own random stream: the same tokens whatever else is in the batch (under a draft model's drawn
    # drafts, run after run with the same engine settings and requests: spec_decode/acceptance.py).
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings; normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted as in vLLM; fast tokenizers decode without such spaces
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow

    def __post_init__(self) -> None:
        self.n = check_int("n", self.n, low=1)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty, low=0.0, open_low=True)
        self.temperature = check_float("temperature", self.temperature, low=0.0, note=" (0 means greedy)")
        self.top_p = check_float("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        self.top_k = check_top_k(self.top_k)
        self.min_p = check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, low=MIN_SEED, high=MAX_SEED, allow_none=True)
            if self.seed + self.n - 1 > MAX_SEED:
                raise ValueError(
                    f"seed + n - 1 must be <= {MAX_SEED} (sample i of n draws with seed + i), got seed={self.seed} "
                    f"and n={self.n}"
                )
        self.stop = check_stop(self.stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in BOOL_FIELDS:
            check_bool(name, getattr(self, name))
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, low=1, allow_none=True)
        self.min_tokens = check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, low=0, allow_none=True)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, low=0, allow_none=True)
        self.logit_bias = check_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a StructuredOutputsParams (from pagedllm import StructuredOutputsParams) "
                f"or None, got {type(self.structured_outputs).__name__}"
            )
        if self.temperature < GREEDY_TEMPERATURE:
            # Greedy: truncation cannot change the argmax, so drop it (the sampler then skips it), as vLLM does.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def validate_for_model(self, vocab_size: int) -> None:
        """The checks that need the vocabulary: token ids must exist, top-N cannot exceed it."""
        for name, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            bad = [token_id for token_id in token_ids if token_id >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be in [0, {vocab_size}] (the vocabulary size) or None, got {value}")

    def distribution_only(self) -> SamplingParams:
        """The settings that make this request's sampling distribution of processed logits (temperature, top-p,
        top-k, min-p) and its seed, without what shapes the logits or ends the output."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# generation_config.json's names -> SamplingParams' (what vLLM's generation_config="auto" takes from the model)
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}  # fmt: skip


def model_sampling_defaults(generation_config) -> dict[str, float | int]:
    """The sampling settings a model's generation_config (a transformers GenerationConfig, or None) sets itself, by
    SamplingParams' names: the values its file gives that differ from transformers' defaults, as vLLM reads them."""
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    return {ours: given[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if given.get(theirs) is not None}


def check_int(name: str, value, low: int, high: int | None = None, allow_none: bool = False) -> int:
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    allowed += " or None" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int {allowed}, got {type(value).__name__} {value!r}")
    if not low <= value <= (value if high is None else high):
        raise ValueError(f"{name} must be an int {allowed}, got {value}")
    return int(value)


def check_float(
    name: str, value, low: float, high: float | None = None, open_low: bool = False, note: str = ""
) -> float:
    if high is None:  # an unbounded range must also say that inf is out
        allowed = f"{'>' if open_low else '>='} {low:g} and finite"
    else:
        allowed = f"in {'(' if open_low else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number {allowed}{note}, got {type(value).__name__} {value!r}")
    value = float(value)
    above_low = value > low if open_low else value >= low
    if not (math.isfinite(value) and above_low and (high is None or value <= high)):
        raise ValueError(f"{name} must be {allowed}{note}, got {value}")
    return value


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def check_top_k(value) -> int:
    allowed = f"top_k must be an int >= -1: -1 or 0 turn it off, 1 to {MAX_TOP_K} keep that many tokens"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{allowed}; got {type(value).__name__} {value!r}")
    if not -1 <= value <= MAX_TOP_K:
        raise ValueError(f"{allowed}; got {value}")
    return max(int(value), 0)


def check_stop(stop) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
    if any(s == "" for s in strings):
        raise ValueError("stop must not contain an empty string")
    return list(strings)


def check_token_ids(name: str, token_ids) -> list[int]:
    if token_ids is None:
        return []
    if not isinstance(token_ids, list | tuple):
        raise TypeError(f"{name} must be a list of token ids (ints >= 0), got {type(token_ids).__name__} {token_ids!r}")
    return [check_int(f"each of {name}", token_id, low=0) for token_id in token_ids]


def check_logit_bias(logit_bias) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    checked = {}
    for token_id, bias in logit_bias.items():
        token_id = check_int("each logit_bias token id", token_id, low=0)
        checked[token_id] = check_float("each logit_bias value", bias, low=-MAX_ABS_LOGIT_BIAS, high=MAX_ABS_LOGIT_BIAS)
    return checked
