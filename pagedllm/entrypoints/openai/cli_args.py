"""`pagedllm serve`'s flags (argparse only, so `pagedllm --help` does not import the server)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_flags


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
    engine = add_engine_flags(parser, "serve")
    engine.add_argument(
        "--engine-core-in-thread",
        action="store_true",
        help="step the engine in a thread of the server process instead of its own process (slower under load)",
    )
