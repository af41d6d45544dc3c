"""Where a mask fill's cost comes from when every row is in its own state, as in the engine: N matchers of
structured_cost's schema, each inside its summary string and advanced each round by one token of its own choosing
(drawn from its mask, never a quote), timed per round: the advance, then the fill. Matchers copied from one compiled
template (what the engine does) against matchers each built from the grammar text (no state shared), filled
serially, on llguidance's executor, and on Python threads (the fill releases the GIL).

    python benchmarks/experiments/mask_fill_sources.py --tokenizer DIR [--rows 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_cost import SCHEMA  # noqa: E402

from pagedllm import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.factory import load_backend  # noqa: E402
from pagedllm.structured_output.llguidance_backend import llguidance_grammar  # noqa: E402


def allowed_tokens(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    backend = load_backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    params = StructuredOutputsParams(json=SCHEMA)
    template = backend.compile(params)
    grammar_text = llguidance_grammar(params)
    prefix = tokenizer.encode('{"name": "Bob", "age": 33, "summary": "This')
    quote_tokens = {token for text, token in tokenizer.get_vocab().items() if '"' in text or "\\" in text}
    built_at = time.perf_counter()
    own = [llguidance.LLMatcher(backend.ll_tokenizer, grammar_text, log_level=0) for _ in range(args.rows)]
    build_s = (time.perf_counter() - built_at) / args.rows
    sets = {"copies": [template.matcher().matcher for _ in range(args.rows)], "own": own}
    for matchers in sets.values():
        for matcher in matchers:
            assert matcher.try_consume_tokens(prefix) == len(prefix)
    words = backend.bitmask_words
    bitmask = np.zeros((args.rows, words), dtype=np.int32)
    rng = np.random.default_rng(0)

    def fill_rows(matchers, rows) -> None:
        for index in rows:
            matchers[index].unsafe_compute_mask_ptr(bitmask[index].ctypes.data, words * 4)

    pools = {threads: ThreadPoolExecutor(threads) for threads in args.threads}
    executors = {threads: llguidance.LLExecutor(num_threads=threads) for threads in args.threads}

    def fillers(matchers):
        yield "serial", lambda: fill_rows(matchers, range(args.rows))
        pairs = [(matcher, index) for index, matcher in enumerate(matchers)]
        for threads, executor in executors.items():
            yield (
                f"executor {threads}",
                lambda e=executor: e.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, args.rows),
            )
        for threads, pool in pools.items():
            parts = np.array_split(np.arange(args.rows), threads)
            yield (
                f"threads {threads}",
                lambda p=pool, parts=parts: list(p.map(lambda rows: fill_rows(matchers, rows), parts)),
            )

    print(f"{args.rows} rows; building a matcher from the grammar text: {1e3 * build_s:.2f} ms each")
    for set_name, matchers in sets.items():
        times: dict[str, list[float]] = {}
        advance = []
        for _ in range(args.rounds):  # each fill sees new states: the variants take turns, an advance after each
            for name, fill in fillers(matchers):
                started = time.perf_counter()
                fill()
                times.setdefault(name, []).append(time.perf_counter() - started)
                choices = []
                for row in bitmask:
                    allowed = [t for t in allowed_tokens(row, len(tokenizer)) if t not in quote_tokens]
                    choices.append(int(rng.choice(allowed)))
                started = time.perf_counter()
                for matcher, token in zip(matchers, choices):
                    assert matcher.try_consume_tokens([token]) == 1
                advance.append(time.perf_counter() - started)
        line = ", ".join(f"{name} {1e6 * statistics.median(v) / args.rows:.1f}" for name, v in times.items())
        print(f"{set_name:7} us a row: {line}; advance {1e6 * statistics.median(advance) / args.rows:.1f}")


if __name__ == "__main__":
    main()
