"""AsyncLLM: concurrent streams equal LLM.generate, cancelling a stream aborts its request and frees its blocks,
bad input is refused without stopping the engine, startup errors reach the caller, shutdown ends every stream."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.async_engine import AsyncLLM, EngineDeadError

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "0123456789"]


@pytest.fixture(scope="module", params=["thread", "process"])
def async_llm(request, llama_dir):
    with AsyncLLM(llama_dir, max_model_len=256, core_in_thread=request.param == "thread") as llm:
        yield llm


async def collect(llm: AsyncLLM, prompt, params: SamplingParams):
    outputs = [output async for output in llm.generate(prompt, params)]
    return outputs


def test_concurrent_streams_equal_llm_generate(async_llm, llama_dir):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 9, 17, 5)]

    async def run_all():
        return await asyncio.gather(*(collect(async_llm, p, q) for p, q in zip(PROMPTS, params)))

    streams = asyncio.run(run_all())
    expected = LLM(llama_dir, max_model_len=256).generate(PROMPTS, params, use_tqdm=False)
    for outputs, reference, param in zip(streams, expected, params):
        final = outputs[-1]
        assert final.finished and [o.finished for o in outputs].count(True) == 1
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        assert final.prompt_token_ids == reference.prompt_token_ids
        # cumulative outputs: each one extends the one before
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[-1] == param.max_tokens


def test_cancelled_stream_is_aborted_and_frees_blocks(async_llm):
    async def cancel_midway():
        stream = await async_llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200))
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 2:
                break  # leaving the loop closes the stream: the request is aborted
        for _ in range(200):
            await asyncio.sleep(0.01)
            if async_llm.stats.num_running == 0 and async_llm.stats.kv_cache_usage == 0.0:
                return stream.request_id
        raise AssertionError(f"the aborted request still holds blocks: {async_llm.stats}")

    request_id = asyncio.run(cancel_midway())
    assert request_id not in async_llm.streams


def test_bad_input_is_refused_and_the_engine_keeps_serving(async_llm):
    async def run():
        with pytest.raises(ValueError, match="vocabulary"):
            await async_llm.add_request({"prompt_token_ids": [10**6]})
        with pytest.raises(ValueError, match="empty"):
            await async_llm.add_request("")
        with pytest.raises(TypeError, match="sampling_params"):
            await async_llm.add_request("x", sampling_params="greedy")
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_request({"prompt_token_ids": [5] * 300})
        # values msgpack cannot carry to the core are refused before anything is registered
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await async_llm.add_request({"prompt_token_ids": [5, 2**64]})
        with pytest.raises(ValueError, match="stop_token_ids holds token id 18446744073709551616"):
            await async_llm.add_request("x", SamplingParams(stop_token_ids=[2**64]))
        with pytest.raises(ValueError, match=r"outside \[-2\*\*63, 2\*\*64 - 1\]"):
            await async_llm.add_request("x", SamplingParams(n=2**64))
        with pytest.raises(ValueError, match="lone surrogate"):
            await async_llm.add_request("x \ud800")
        assert async_llm.streams == {}
        return await collect(async_llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))

    outputs = asyncio.run(run())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert async_llm.stats.num_running == 0 and async_llm.stats.num_waiting == 0


def test_startup_error_reaches_the_caller(tmp_path):
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        AsyncLLM(str(tmp_path / "missing"))


def test_shutdown_ends_streams_and_refuses_new_requests(llama_dir):
    llm = AsyncLLM(llama_dir, max_model_len=256, core_in_thread=True)

    async def run():
        stream = await llm.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200))
        seen = []
        async for output in stream:
            seen.append(output)
            if len(seen) == 1:
                llm.shutdown()
        with pytest.raises(EngineDeadError):
            await llm.add_request(PROMPTS[0])
        return seen

    seen = asyncio.run(run())
    assert len(seen[-1].outputs[0].token_ids) < 200  # the stream ended when the engine stopped
    assert not llm.is_running
    llm.shutdown()  # twice is fine
