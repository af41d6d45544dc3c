"""lm-eval against `pagedllm serve` on the default model: two small local tasks (generate_until and multiple_choice
via echo + logprobs) run with `lm_eval --model local-completions`, scores printed; and the multiple-choice
log-likelihoods equal transformers' on the same GGUF (float32, 1e-3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra (pip install -e '.[test]')")
pytest.importorskip("lm_eval", reason="needs lm-eval (pip install -e '.[test]')")

from server_process import start_server, stop_server  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["pagedllm_capitals", "pagedllm_facts_mc"]
pytestmark = pytest.mark.slow


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    running = start_server(None, tmp_path_factory.mktemp("lm_eval") / "server.log", "--max-model-len", "512")
    running.model = httpx.get(f"{running.base_url}/v1/models").json()["data"][0]["id"]
    yield running
    if running.process.poll() is None:  # test_sigint_exits_zero (the last test) normally stopped it already
        running.process.kill()
        running.process.wait()


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


def test_multiple_choice_loglikelihoods_equal_transformers(default_server):
    """Each choice's log-likelihood as lm-eval computes it from the server (echo + logprobs over context +
    continuation tokens) equals the same sum from transformers on the GGUF in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.loader.default_model import default_model_path

    pairs = [(doc["question"], choice) for doc in read_jsonl("facts_mc.jsonl") for choice in doc["choices"]]

    def encode(text: str) -> list[int]:
        response = httpx.post(f"{default_server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return response.json()["tokens"]

    served = []
    for context, continuation in pairs:
        whole, context_ids = encode(context + continuation), encode(context)
        body = {"model": default_server.model, "prompt": whole, "echo": True, "logprobs": 1, "max_tokens": 1}
        response = httpx.post(f"{default_server.base_url}/v1/completions", json=body | {"temperature": 0}, timeout=60)
        assert response.status_code == 200, response.text
        token_logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
        served.append((whole, len(context_ids), sum(token_logprobs[len(context_ids) : len(whole)])))

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for (context, continuation), (whole, context_len, served_logprob) in zip(pairs, served):
        with torch.no_grad():
            log_softmax = torch.log_softmax(reference(torch.tensor([whole])).logits[0].float(), dim=-1)
        expected = sum(log_softmax[position - 1, whole[position]].item() for position in range(context_len, len(whole)))
        assert served_logprob == pytest.approx(expected, abs=1e-3), (context, continuation)


def test_sigint_exits_zero(default_server):
    """Ctrl-C (SIGINT) stops the server cleanly with status 0 and no traceback logged. Last: it stops the server."""
    assert stop_server(default_server, signal.SIGINT) == 0, default_server.log()
    assert "Traceback" not in default_server.log(), default_server.log()
