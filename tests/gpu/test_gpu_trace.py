"""Tracing on a CUDA GPU (`pytest -m gpu tests/gpu`): the device spans come from CUDA events placed on the host clock,
with overlapped steps and CUDA graphs on, and the counters still agree with the outputs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import VOCAB_SIZE

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
]
CLOCK_SLACK_US = 1000  # the reference event's host time is known to within a few microseconds; drift is small


def test_cuda_trace_places_device_work_inside_its_step(llama_dir, tmp_path):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randrange(1, 300))]}
               for _ in range(12)]  # fmt: skip
    path = tmp_path / "trace.json"
    llm = LLM(llama_dir, num_kv_blocks=1024, max_num_seqs=16, trace_file=str(path), trace_kv_every=5)
    assert llm.llm_engine.async_scheduling and llm.llm_engine.worker.graphs is not None
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert sum(step["args"]["generated"] for step in steps.values()) == generated
    host = {(e["args"]["step"], e["name"]): e for e in events if e.get("cat") == "host"}
    device = [e for e in events if e.get("cat") == "device"]
    assert len(device) == 2 * len(steps)
    for span in device:
        step_id = span["args"]["step"]
        queued = host[step_id, "plan"]["ts"] + host[step_id, "plan"]["dur"]  # the device cannot start before this
        resolved = host[step_id, "resolve"]["ts"] + host[step_id, "resolve"]["dur"]  # nor end after its tokens are back
        assert queued - CLOCK_SLACK_US <= span["ts"] and span["ts"] + span["dur"] <= resolved + CLOCK_SLACK_US
        assert span["name"] == "sampling" or span["dur"] > 0
