"""A GGUF model's prompt rows multiply the weights in float and its decoding rows take the grouped kernel
(layers/step_rows.py), so a sequence that decodes while other requests arrive (their prompt chunks in its steps), end
on a stop token or EOS, or are aborted keeps the very tokens and logprobs it has alone, with async scheduling on and
off; and those mixed steps did split their rows."""

from __future__ import annotations

import pytest
from loader.test_gguf_loader import TOKENS, tiny_weights, write_tiny_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.layers import step_rows

VOCAB = len(TOKENS)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_weights("llama", 16, tied=False), 16)
    return path


def prompt(length: int, offset: int) -> dict:
    return {"prompt_token_ids": [(offset + 7 * i) % (VOCAB - 3) + 3 for i in range(length)]}


def logprob_values(output) -> list[dict[int, float]]:
    return [{token: entry.logprob for token, entry in step.items()} for step in output.logprobs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_decoding_sequence_keeps_its_bits_while_prompts_arrive_end_and_abort(
    gguf_path, async_scheduling, monkeypatch, tmp_path
):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(str(gguf_path), device="cpu", skip_tokenizer_init=True, async_scheduling=async_scheduling)
    assert llm.llm_engine.resolved.kernels.gguf_prompt_rows == "float"
    mixed_steps = []
    split = step_rows.split
    monkeypatch.setattr(step_rows, "split", lambda metadata: mixed_steps.append(split(metadata)) or mixed_steps[-1])
    watched = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    alone = llm.generate(prompt(12, 0), watched, use_tqdm=False)[0].outputs[0]
    stopping = SamplingParams(temperature=0, max_tokens=12)
    stopping_alone = llm.generate(prompt(40, 5), stopping, use_tqdm=False)[0].outputs[0].token_ids
    stopping.stop_token_ids = [stopping_alone[2]]  # ends at its third token (or earlier, on EOS)
    mixed_steps.clear()
    engine = llm.llm_engine
    finished = {}

    def run(steps: int | None) -> None:
        while steps is None and engine.has_unfinished_requests() or steps:
            finished.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
            steps = None if steps is None else steps - 1

    engine.add_request("watched", prompt(12, 0), watched, stream=False)
    run(3)
    engine.add_request("stops", prompt(40, 5), stopping, stream=False)  # its prompt beside a decoding row
    run(2)
    engine.add_request("aborted", prompt(30, 11), SamplingParams(temperature=0, max_tokens=20), stream=False)
    run(2)
    engine.abort_request("aborted")
    run(None)
    assert finished["watched"].token_ids == alone.token_ids
    assert logprob_values(finished["watched"]) == logprob_values(alone)
    assert finished["stops"].token_ids[-1] in (stopping_alone[2], len(TOKENS) - 1)
    assert len(finished["stops"].token_ids) <= 3
    assert any(rows is not None and rows.decoding is not None for rows in mixed_steps)  # prompt and decoding rows
