"""The embedded SmolLM2-135M-Instruct GGUF: pagedllm's greedy chat answers equal transformers' on the same file
dequantized (float32 on CPU; transformers dequantizes the GGUF with its own loader, pagedllm with quantization=None);
the default engine (its blocks kept quantized: bfloat16 products, so near ties may differ, as
benchmarks/gguf_accuracy.py reports) answers the README's question."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "def fibonacci(n):  # complete this Python function",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM()  # no model: the embedded default


@pytest.fixture(scope="module")
def dequantized():
    return LLM(quantization=None)


def test_default_model_greedy_matches_transformers(dequantized, default_reference):
    llm = dequantized
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for conversation, output in zip(conversations, outputs):
        prompt = llm.chat_prompt(conversation)["prompt_token_ids"]
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = default_reference.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=llm.get_tokenizer().pad_token_id or 0,
            )
        expected_tokens = expected[0, len(prompt) :].tolist()
        got = output.outputs[0].token_ids
        # both stop after the eos token or at NEW_TOKENS, whichever comes first
        assert got == expected_tokens, conversation[0]["content"]


def test_default_model_answers_the_readme_question(llm):
    params = SamplingParams(temperature=0, max_tokens=32)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    assert "Paris" in answer[0].outputs[0].text
    assert answer[0].outputs[0].finish_reason == "stop"
