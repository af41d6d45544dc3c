"""Sampler.warmup() runs every compiled function of the sampler (layers/compile.fusible) at one row and at several,
the two shapes torch.compile specialises, so no step meets a compilation later. Checked on CPU by recording the calls;
the GPU test counts compilations."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sampling import sampler as sampler_module
from pagedllm.sampling import state as sampling_state
from pagedllm.sampling.batch import build_sampling_batch
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler

VOCAB = 64
MODULES = (sampler_module, sampling_state)


def compiled_functions() -> list[tuple[object, str]]:
    """(module, name) of every function the sampler's modules mark as fusible (they have a compiled twin)."""
    return [
        (module, name)
        for module in MODULES
        for name, value in vars(module).items()
        if callable(value) and getattr(value, "compiled", None) is not None and value.__module__ == module.__name__
    ]


COMPILED = compiled_functions()  # before any test replaces them


@pytest.fixture
def calls(monkeypatch) -> set[tuple[str, str]]:
    """(function name, 'one row' or 'rows') of every call to a compiled function."""
    seen = set()
    for module, name in COMPILED:
        function = getattr(module, name)

        def recording(x, *args, function=function, name=name):
            seen.add((name, "one row" if x.shape[0] == 1 else "rows"))
            return function(x, *args)

        monkeypatch.setattr(module, name, recording)
    return seen


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_k=rng.choice([0, 0, 5]),
        top_p=rng.choice([1.0, 1.0, 0.8]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        seed=rng.choice([None, 7]),
        logprobs=rng.choice([None, 2]),
    )


def test_warmup_runs_every_compiled_function_at_one_row_and_at_several(calls):
    assert {name for _, name in COMPILED} == {"exponential_race", "exponential_race_min_p", "penalise"}
    sampler = Sampler(num_states=8, vocab_size=VOCAB, device=torch.device("cpu"), seed=0)
    sampler.warmup()
    warmed = set(calls)
    assert warmed == {(name, shape) for _, name in COMPILED for shape in ("one row", "rows")}
    assert (
        not sampler.penalties.active_state_indices and not sampler.generators.by_state_index
    )  # it leaves no state behind
    calls.clear()
    rng = random.Random(0)
    for _ in range(200):  # whatever a batch holds, it calls nothing that the warm-up did not
        params = [random_params(rng) for _ in range(rng.randint(1, 6))]
        for state_index, p in enumerate(params):
            sampler.add_request(state_index, p, prompt_token_ids=[1, 2])
        sampler(torch.randn(len(params), VOCAB), build_sampling_batch(params, range(len(params)), [0] * len(params)))
        for state_index in range(len(params)):
            sampler.release(state_index)
    assert calls and calls <= warmed
