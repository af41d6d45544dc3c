"""The engine's executor: the Worker is an Executor, an engine runs on whatever executor it is given (here one
without a model), and device timings stay on while any step listener asks for them."""

from __future__ import annotations

import torch

import pagedllm.engine.engine as engine_module
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.executor.executor import Executor
from pagedllm.executor.step_output import StepEvents, StepOutput
from pagedllm.sampling.sampler import SamplerOutput

TOKEN = 11
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(3)]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


class ConstantExecutor:
    """An Executor without a model: every sampled row gets TOKEN, and while timings are on each step carries host
    clock readings as its device timings."""

    device = torch.device("cpu")

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks
        self.device_timings = False
        self.num_plans = 0
        self.shut_down = False

    def execute(self, plan, previous=None, masks=None) -> StepOutput:
        assert not self.shut_down, "a step after shutdown()"
        if masks is not None:
            masks()  # the protocol: asked for once per constrained plan
        self.num_plans += 1
        events = StepEvents.create(self.device) if self.device_timings else None
        if events is not None:
            for mark in (events.start, events.forward_done, events.end):
                mark.record()
        sampled = SamplerOutput(torch.full((plan.num_sampled,), TOKEN)) if plan.num_sampled else None
        return StepOutput(plan.step_id, sampled, events=events)

    def set_device_timings(self, on: bool) -> None:
        self.device_timings = on

    def shutdown(self) -> None:
        self.shut_down = True


def finished_tokens(engine: LLMEngine) -> dict[str, list[int]]:
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, PARAMS, stream=False)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {output.request_id: output.outputs[0].token_ids for output in engine.step() if output.finished}
    return finished


def test_the_worker_is_an_executor(llama_dir):
    assert isinstance(LLM(llama_dir).llm_engine.worker, Executor)


def test_an_engine_runs_on_the_executor_it_is_given(llama_dir, monkeypatch):
    """No Worker is built: the given executor runs every step, its block count sizes the block manager, and the
    engine's shutdown reaches it."""

    def no_worker(*args):
        raise AssertionError("the engine built an executor of its own")

    monkeypatch.setattr(engine_module, "make_executor", no_worker)
    executor = ConstantExecutor(num_kv_blocks=37)
    assert isinstance(executor, Executor)
    engine = LLMEngine(EngineConfig(llama_dir, skip_tokenizer_init=True), executor)
    assert engine.worker is executor and engine.block_manager.num_blocks == 37
    assert finished_tokens(engine) == {str(index): [TOKEN] * PARAMS.max_tokens for index in range(len(PROMPTS))}
    assert executor.num_plans >= PARAMS.max_tokens
    engine.shutdown()
    assert executor.shut_down


def test_device_timings_stay_on_while_any_listener_asks_for_them(llama_dir):
    """Two listeners ask for device timings: removing one leaves the other's records timed; removing the other
    leaves an untimed listener's records without them (no per-step cost)."""
    engine = LLM(llama_dir).llm_engine
    first, second, untimed = [], [], []
    engine.add_step_listener(first.append, device_timings=True)
    engine.add_step_listener(second.append, device_timings=True)
    engine.add_step_listener(untimed.append)
    engine.remove_step_listener(first.append)
    finished_tokens(engine)
    assert not first and second
    assert all(record.events is not None and record.events.forward_ms() > 0 for record in second)
    engine.remove_step_listener(second.append)
    untimed.clear()
    finished_tokens(engine)
    assert untimed and all(record.events is None for record in untimed)


def test_stopping_a_trace_keeps_another_listeners_device_timings(llama_dir):
    """Stopping a trace withdraws the tracer's request for device timings, not another listener's."""
    engine = LLM(llama_dir).llm_engine
    records = []
    engine.add_step_listener(records.append, device_timings=True)
    engine.start_trace(None)
    engine.stop_trace()
    finished_tokens(engine)
    assert records and all(record.events is not None and record.events.forward_ms() > 0 for record in records)
