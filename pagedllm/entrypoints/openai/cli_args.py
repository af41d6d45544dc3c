"""`pagedllm serve`'s flags (argparse only, so `pagedllm --help` does not import the server)."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_flags

# Generous but finite: a 128k-token prompt is ~0.5 MB of text or ~1 MB of token ids in JSON. A larger body is a 413
# before any of it is parsed.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDLLM_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
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
