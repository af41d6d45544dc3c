"""`pagedllm serve`'s flags (argparse only, so `pagedllm --help` does not import the server)."""

from __future__ import annotations

import argparse


def add_serve_flags(parser: argparse.ArgumentParser, default_threads: int) -> None:
    parser.add_argument("--model", help="Hugging Face model directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens (model's limit)")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a batch (256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step (8192)")
    engine.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (auto: float32 on CPU)")
    engine.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when available)")
    engine.add_argument("--seed", type=int, default=0, help="random seed (0)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs to shard the model over (1)")
    engine.add_argument("--threads", type=int, default=default_threads, help=f"CPU threads ({default_threads})")
    engine.add_argument(
        "--skip-tokenizer-init", action="store_true", help="no tokenizer: prompts are token ids, outputs carry no text"
    )
    engine.add_argument(
        "--engine-core-in-thread",
        action="store_true",
        help="step the engine in a thread of the server process instead of its own process (slower under load)",
    )
