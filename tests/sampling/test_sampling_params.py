"""Every invalid SamplingParams value is refused with the field's name and its allowed range; valid values are
normalised the way vLLM does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedllm.sampling.params import SamplingParams

NAN, INF = math.nan, math.inf
BAD = [  # (field, value, exception, words the message must hold)
    ("n", 0, ValueError, "n must be an int >= 1"),
    ("n", 1.5, TypeError, "n must be an int"),
    ("n", True, TypeError, "n must be an int"),
    ("presence_penalty", 2.5, ValueError, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", -3, ValueError, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", NAN, ValueError, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", "0.1", TypeError, "presence_penalty must be a number"),
    ("frequency_penalty", INF, ValueError, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", True, TypeError, "frequency_penalty must be a number"),
    ("repetition_penalty", 0, ValueError, "repetition_penalty must be > 0 and finite"),
    ("repetition_penalty", -1.0, ValueError, "repetition_penalty must be > 0"),
    ("repetition_penalty", INF, ValueError, "repetition_penalty must be > 0 and finite"),
    ("repetition_penalty", NAN, ValueError, "repetition_penalty must be > 0"),
    ("temperature", -0.5, ValueError, "temperature must be >= 0 and finite"),
    ("temperature", NAN, ValueError, "temperature must be >= 0"),
    ("temperature", INF, ValueError, "temperature must be >= 0 and finite"),
    ("temperature", "0.5", TypeError, "temperature must be a number"),
    ("temperature", None, TypeError, "temperature must be a number"),
    ("temperature", True, TypeError, "temperature must be a number"),
    ("top_p", 0.0, ValueError, "top_p must be in (0, 1]"),
    ("top_p", 1.5, ValueError, "top_p must be in (0, 1]"),
    ("top_p", NAN, ValueError, "top_p must be in (0, 1]"),
    ("top_p", None, TypeError, "top_p must be a number"),
    ("top_k", -2, ValueError, "top_k must be an int >= -1: -1 or 0 turn it off, 1 to 2147483647"),
    ("top_k", 2**63, ValueError, "1 to 2147483647"),
    ("top_k", 2**31, ValueError, "1 to 2147483647"),
    ("top_k", 1.5, TypeError, "top_k must be an int"),
    ("top_k", True, TypeError, "top_k must be an int"),
    ("top_k", "5", TypeError, "top_k must be an int"),
    ("min_p", -0.1, ValueError, "min_p must be in [0, 1]"),
    ("min_p", 1.1, ValueError, "min_p must be in [0, 1]"),
    ("min_p", NAN, ValueError, "min_p must be in [0, 1]"),
    ("seed", True, TypeError, "seed must be an int"),
    ("seed", 2**64, ValueError, "seed must be an int in [-9223372036854775808, 18446744073709551615]"),
    ("seed", -(2**63) - 1, ValueError, "seed must be an int in"),
    ("seed", "x", TypeError, "seed must be an int"),
    ("seed", 1.0, TypeError, "seed must be an int"),
    ("stop", "", ValueError, "stop must not contain an empty string"),
    ("stop", ["a", ""], ValueError, "stop must not contain an empty string"),
    ("stop", [1], TypeError, "stop must be a str or a list of str"),
    ("stop", 5, TypeError, "stop must be a str or a list of str"),
    ("stop", {"a"}, TypeError, "stop must be a str or a list of str"),
    ("stop_token_ids", 5, TypeError, "stop_token_ids must be a list of token ids"),
    ("stop_token_ids", "5", TypeError, "stop_token_ids must be a list of token ids"),
    ("stop_token_ids", [-1], ValueError, "each of stop_token_ids must be an int >= 0"),
    ("stop_token_ids", [1.5], TypeError, "each of stop_token_ids must be an int"),
    ("stop_token_ids", [True], TypeError, "each of stop_token_ids must be an int"),
    ("ignore_eos", 1, TypeError, "ignore_eos must be True or False"),
    ("ignore_eos", None, TypeError, "ignore_eos must be True or False"),
    ("max_tokens", 0, ValueError, "max_tokens must be an int >= 1 or None"),
    ("max_tokens", 1.5, TypeError, "max_tokens must be an int >= 1 or None"),
    ("max_tokens", True, TypeError, "max_tokens must be an int"),
    ("min_tokens", -1, ValueError, "min_tokens must be an int >= 0"),
    ("min_tokens", 17, ValueError, "min_tokens must be <= max_tokens=16"),
    ("min_tokens", None, TypeError, "min_tokens must be an int"),
    ("logprobs", -1, ValueError, "logprobs must be an int >= 0 or None"),
    ("logprobs", True, TypeError, "logprobs must be an int"),
    ("logprobs", 2.0, TypeError, "logprobs must be an int"),
    ("prompt_logprobs", -1, ValueError, "prompt_logprobs must be an int >= 0 or None"),
    ("skip_special_tokens", "yes", TypeError, "skip_special_tokens must be True or False"),
    ("spaces_between_special_tokens", 0, TypeError, "spaces_between_special_tokens must be True or False"),
    ("include_stop_str_in_output", None, TypeError, "include_stop_str_in_output must be True or False"),
    ("logit_bias", [1], TypeError, "logit_bias must be a dict of token id -> bias"),
    ("logit_bias", {1: NAN}, ValueError, "each logit_bias value must be in [-100, 100]"),
    ("logit_bias", {1: -INF}, ValueError, "each logit_bias value must be in [-100, 100]"),
    ("logit_bias", {1: 100.5}, ValueError, "each logit_bias value must be in [-100, 100]"),
    ("logit_bias", {1: "x"}, TypeError, "each logit_bias value must be a number"),
    ("logit_bias", {-1: 1.0}, ValueError, "each logit_bias token id must be an int >= 0"),
    ("logit_bias", {"5": 1.0}, TypeError, "each logit_bias token id must be an int"),
    ("logit_bias", {True: 1.0}, TypeError, "each logit_bias token id must be an int"),
    ("structured_outputs", {"regex": "a+"}, TypeError, "structured_outputs must be a StructuredOutputsParams"),
    ("structured_outputs", "a+", TypeError, "structured_outputs must be a StructuredOutputsParams"),
]


@pytest.mark.parametrize(("field", "value", "exception", "words"), BAD, ids=[f"{f}={v!r}" for f, v, *_ in BAD])
def test_bad_value_is_refused_with_its_name_and_range(field, value, exception, words):
    with pytest.raises(exception) as error:
        SamplingParams(**{field: value})
    assert words in str(error.value)
    assert type(error.value) is exception  # a TypeError is not a ValueError and the other way round


VOCAB = 384
BAD_FOR_MODEL = [
    (dict(stop_token_ids=[3, VOCAB]), f"stop_token_ids holds token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
    (dict(logit_bias={VOCAB + 5: 1.0}), f"logit_bias holds token id {VOCAB + 5} outside the vocabulary"),
    (dict(logprobs=VOCAB + 1), f"logprobs must be in [0, {VOCAB}]"),
    (dict(prompt_logprobs=VOCAB + 1), f"prompt_logprobs must be in [0, {VOCAB}]"),
]


@pytest.mark.parametrize(("kwargs", "words"), BAD_FOR_MODEL)
def test_values_outside_the_vocabulary_are_refused_for_the_model(kwargs, words):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as error:
        params.validate_for_model(VOCAB)
    assert words in str(error.value)


def test_values_at_the_edges_are_accepted():
    params = SamplingParams(stop_token_ids=[VOCAB - 1], logit_bias={VOCAB - 1: -100}, logprobs=VOCAB, prompt_logprobs=0)
    params.validate_for_model(VOCAB)
    for seed in (2**64 - 1, -(2**63), 0):
        SamplingParams(seed=seed)
    SamplingParams(top_k=2**31 - 1, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, min_tokens=16)


def test_normalisation_follows_vllm():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == 0
    tiny = SamplingParams(temperature=1e-6, top_p=0.5, top_k=3, min_p=0.2)
    assert tiny.greedy and (tiny.temperature, tiny.top_p, tiny.top_k, tiny.min_p) == (0.0, 1.0, 0, 0.0)
    assert not SamplingParams(temperature=1e-5).greedy
    numpy_values = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), logit_bias={np.int64(3): 1})
    assert type(numpy_values.top_k) is int and type(numpy_values.temperature) is float
    assert numpy_values.logit_bias == {3: 1.0} and type(next(iter(numpy_values.logit_bias))) is int
    assert SamplingParams(presence_penalty=0.1).uses_penalties and not SamplingParams().uses_penalties


def test_model_sampling_defaults_are_what_its_generation_config_sets():
    """vLLM's generation_config="auto": the sampling values the file gives; eos ids, do_sample and transformers'
    own defaults (top_k 50 when the file sets none) are not sampling defaults."""
    from transformers import GenerationConfig

    from pagedllm.sampling.params import model_sampling_defaults

    qwen3_like = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, eos_token_id=[1, 2])
    assert model_sampling_defaults(qwen3_like) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert model_sampling_defaults(GenerationConfig(bos_token_id=1, eos_token_id=2)) == {}
    assert model_sampling_defaults(None) == {}
    assert SamplingParams(**model_sampling_defaults(GenerationConfig(repetition_penalty=1.2))).repetition_penalty == 1.2
