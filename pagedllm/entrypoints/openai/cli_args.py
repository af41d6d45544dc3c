"""`pagedllm serve`'s flags (argparse only, so `pagedllm --help` does not import the server)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_flags

# The names of tool_parsers.TOOL_PARSERS and reasoning_parsers.REASONING_PARSERS, here so that --help imports neither
# (a test checks that they agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# Generous but finite: a 128k-token prompt is ~0.5 MB of text or ~1 MB of token ids in JSON. A larger body is a 413
# before any of it is parsed.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide when to call tools (tool_choice 'auto', the default with tools); needs "
        "--tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls: hermes (<tool_call> JSON </tool_call>: Hermes, Qwen2.5, Qwen3), "
        "llama3_json (Llama 3.1+ JSON), mistral ([TOOL_CALLS] [...])",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split the model's <think>...</think> into reasoning_content: deepseek_r1 (always thinks first), "
        "qwen3 (thinks when it opens <think>)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"a request body larger than this is refused with a 413 (default {DEFAULT_MAX_REQUEST_BYTES} = 32 MiB; "
        "0: no limit)",
    )
    engine = add_engine_flags(parser, "serve")
    engine.add_argument(
        "--engine-core-in-thread",
        action="store_true",
        help="step the engine in a thread of the server process instead of its own process (slower under load)",
    )
