"""Traced runs of the tiny model for the trace tests: the engine's own results and step records beside the trace."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from conftest import VOCAB_SIZE

from pagedllm import LLM, RequestOutput, SamplingParams
from pagedllm.trace.step_record import StepRecord


@dataclass
class TracedRun:
    llm: LLM
    outputs: list[RequestOutput]  # every finished request, both passes
    records: list[StepRecord]  # every step, as a plain listener saw it
    trace: dict  # the file, loaded
    path: Path


def shared_prefix_prompts(count: int = 10, seed: int = 2) -> list[dict]:
    """Odd prompts share a 40-token prefix (two full blocks of 16), so a second pass hits the prefix cache."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, VOCAB_SIZE) for _ in range(40)]
    prompts = []
    for index in range(count):
        tail = [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(1, 30))]
        prompts.append({"prompt_token_ids": (prefix if index % 2 else []) + tail})
    return prompts


def varied_params(count: int, shortest: int = 3) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=shortest + index % 6, ignore_eos=True) for index in range(count)]


def traced_generate(model_dir: str, path: Path, passes: int = 2, shortest: int = 3, **llm_kwargs) -> TracedRun:
    """generate() the same prompts `passes` times on one traced LLM (later passes hit the prefix cache)."""
    llm = LLM(model_dir, trace_file=str(path), **llm_kwargs)
    records: list[StepRecord] = []
    llm.llm_engine.add_step_listener(records.append)
    prompts = shared_prefix_prompts()
    outputs = []
    for _ in range(passes):
        outputs += llm.generate(prompts, varied_params(len(prompts), shortest), use_tqdm=False)
    return TracedRun(llm, outputs, records, json.loads(path.read_text()), path)


def events(trace: dict, cat: str, name: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("cat") == cat and (name is None or e["name"] == name)]


def step_total(trace: dict, key: str) -> int:
    return sum(event["args"][key] for event in events(trace, "step"))
