"""The host's mask fill alone, outside the engine: 256 matchers of structured_cost's schema, each inside its long
summary string (the state the benchmark's rows decode in), serial against llguidance's executor at 2-16 threads.

    python benchmarks/experiments/mask_fill_micro.py --tokenizer DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import llguidance
import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_cost import SCHEMA  # noqa: E402

from pagedllm import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.factory import load_backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    backend = load_backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
    prefix = tokenizer.encode('{"name": "Bob", "age": 33, "summary": "This is a long')
    matchers = []
    for _ in range(args.rows):
        matcher = grammar.matcher()
        assert all(matcher.accept_token(token) for token in prefix)
        matchers.append(matcher)
    bitmask = np.zeros((args.rows, backend.bitmask_words), dtype=np.int32)
    pairs = [(matcher.matcher, index) for index, matcher in enumerate(matchers)]

    def serial():
        for matcher, row in zip(matchers, bitmask):
            matcher.fill_bitmask(row)

    variants = {"serial": serial}
    for threads in (2, 4, 8, 16):
        executor = llguidance.LLExecutor(num_threads=threads)
        variants[f"executor {threads}"] = lambda executor=executor: executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, args.rows
        )
    times = {name: [] for name in variants}
    for _ in range(7):
        for name, function in variants.items():
            started = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - started)
    for name, values in times.items():
        print(f"{name:12} {1e6 * statistics.median(values) / args.rows:6.1f} us a row ({args.rows} rows)")


if __name__ == "__main__":
    main()
