"""lm-eval against `pagedllm serve` on the default model: two small local tasks (generate_until and multiple_choice
via echo + logprobs) run with `lm_eval --model local-completions`, scores printed; and the multiple-choice
log-likelihoods equal transformers' on the same GGUF (float32, 1e-3). The server is the session's default-model one
(tests/conftest.py), shared with test_structured_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
pytest.importorskip("lm_eval", reason="needs lm-eval (pip install -e '.[test]')")


TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["pagedllm_capitals", "pagedllm_facts_mc"]
pytestmark = pytest.mark.slow


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines() if line.strip()]


def test_lm_eval_local_completions(default_server, tmp_path):
    # What lm-eval sends: stop strings (generate_until), echo + logprobs (multiple_choice). Checked first, so that
    # a server without them fails in a second instead of through lm-eval's retries.
    for probe in ({"stop": ["\n"]}, {"echo": True, "logprobs": 1}):
        body = {"model": default_server.model, "prompt": "The sky is", "max_tokens": 1} | probe
        response = httpx.post(f"{default_server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
    model_args = ",".join(
        [
            f"base_url={default_server.base_url}/v1/completions",
            f"model={default_server.model}",
            "tokenizer_backend=remote",
            "num_concurrent=4",
            "max_retries=1",
            "max_length=512",
        ]
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR), "--output_path", str(tmp_path)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": ""}
    result = subprocess.run(command, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(next(tmp_path.rglob("results*.json")).read_text())["results"]
    scores = {
        "capitals exact_match": results["pagedllm_capitals"]["exact_match,none"],
        "facts_mc acc": results["pagedllm_facts_mc"]["acc,none"],
        "facts_mc acc_norm": results["pagedllm_facts_mc"]["acc_norm,none"],
    }
    print(f"\nlm-eval on {default_server.model}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    assert all(0.0 <= score <= 1.0 for score in scores.values())
    assert scores["capitals exact_match"] > 0.5  # SmolLM2-135M-Instruct knows most of these capitals


def test_multiple_choice_loglikelihoods_equal_transformers(default_server, default_reference):
    """Each choice's log-likelihood as lm-eval computes it from the server (echo + logprobs over context +
    continuation tokens) equals the same sum from transformers on the GGUF in float32. All choices go in one request
    (a list of prompts) and one padded reference batch."""
    import torch

    pairs = [(doc["question"], choice) for doc in read_jsonl("facts_mc.jsonl") for choice in doc["choices"]]

    def encode(text: str) -> list[int]:
        response = httpx.post(f"{default_server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return response.json()["tokens"]

    wholes = [encode(context + continuation) for context, continuation in pairs]
    context_lens = [len(encode(context)) for context, _ in pairs]
    body = {"model": default_server.model, "prompt": wholes, "echo": True, "logprobs": 1, "max_tokens": 1}
    response = httpx.post(f"{default_server.base_url}/v1/completions", json=body | {"temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    served = [
        sum(choice["logprobs"]["token_logprobs"][context_len : len(whole)])
        for choice, whole, context_len in zip(choices, wholes, context_lens)
    ]

    # Padded on the right: a causal model's logits at the real positions never see the padding.
    longest = max(len(whole) for whole in wholes)
    input_ids = torch.tensor([whole + [0] * (longest - len(whole)) for whole in wholes])
    attention_mask = (torch.arange(longest) < torch.tensor([[len(whole)] for whole in wholes])).long()
    with torch.no_grad():
        logits = default_reference(input_ids, attention_mask=attention_mask).logits
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    for row, (pair, whole, context_len) in enumerate(zip(pairs, wholes, context_lens)):
        expected = sum(
            log_softmax[row, position - 1, whole[position]].item() for position in range(context_len, len(whole))
        )
        assert served[row] == pytest.approx(expected, abs=1e-3), pair
